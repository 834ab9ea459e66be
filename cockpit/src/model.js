// The page's view of gpuguardd, kept current from its D-Bus interface alone: ObjectManager
// proxies for the Gpu objects, PropertiesChanged for the manager, the manager's signals for
// the event feed. Nothing here polls. React components read `model.state` and re-render on
// the model's "changed" event.

import { escaped, escapeText } from "./escape.js";

const cockpit = window.cockpit;
const _ = cockpit.gettext;

export const NAME = "org.gpuguard.GpuGuard1";
export const MANAGER_PATH = "/org/gpuguard/GpuGuard1";
export const MANAGER_IFACE = "org.gpuguard.GpuGuard1.Manager";
export const GPU_IFACE = "org.gpuguard.GpuGuard1.Gpu";
const DBUS_ERROR = "org.gpuguard.GpuGuard1.Error.";
const HISTORY_COUNT = 20;
const EVENTS_KEPT = 50;
// A GPU's memory moving is a hint that holders came or went before the daemon's next holder
// scan says so (the daemon spaces its own scans by their cost); it can move all the time on a
// busy GPU, so it asks for holders at most this often (the age of a scan ListHolders serves).
const MEMORY_HINT_MS = 1000;
// Sweep calls get a timeout (cockpit's calls have none): the grace period plus this for the
// SIGKILL wait, NVML's verification and a sweep of the same GPU that runs first.
const SWEEP_SLACK_MS = 10 * 60 * 1000;
const DEFAULT_GRACE_MS = 60 * 60 * 1000; // the daemon's upper bound when the page does not know

// Variants arrive as {t, v}, also nested inside a{sv} values: plain values all the way down,
// every string escaped for display (escape.js) where it comes in, as the CLI escapes all it
// prints: process names, command lines, units and paths are whoever started the process's
// text, and a bidi override or a control character must show as what it is.
export function unwrap(value) {
    if (Array.isArray(value))
        return value.map(unwrap);
    if (value !== null && typeof value === "object") {
        const keys = Object.keys(value);
        if (keys.length === 2 && typeof value.t === "string" && "v" in value)
            return unwrap(value.v);
        const out = {};
        for (const key of keys)
            out[escapeText(key)] = unwrap(value[key]);
        return out;
    }
    return typeof value === "string" ? escapeText(value) : value;
}

// One message for every way a call can fail: the daemon's own errors, the bus's, Cockpit's.
export function errorMessage(error) {
    if (!error)
        return _("Unknown error");
    const name = error.name || "";
    // The daemon's messages quote what the caller sent (a GPU, a unit): escaped as the rest.
    const message = escapeText(error.message || "");
    if (name === DBUS_ERROR + "NotAuthorized")
        return cockpit.format(_("Not authorized: $0"), message || _("gpuguardd refused the request."));
    if (name === DBUS_ERROR + "InvalidArgument")
        return cockpit.format(_("Invalid request: $0"), message);
    if (name === DBUS_ERROR + "NvmlError")
        return cockpit.format(_("NVML failed: $0"), message);
    if (name === DBUS_ERROR + "Failed")
        return cockpit.format(_("gpuguardd failed: $0"), message);
    if (name === "org.freedesktop.DBus.Error.ServiceUnknown" || name === "org.freedesktop.DBus.Error.NameHasNoOwner" ||
        error.problem === "not-found")
        return _("gpuguardd is not running.");
    if (name === "org.freedesktop.DBus.Error.NoReply" || error.problem === "timeout")
        return _("gpuguardd did not answer in time.");
    if (error.problem === "access-denied")
        return _("Administrative access is required to sweep: turn it on in Cockpit's top bar.");
    if (error.problem === "disconnected" || error.problem === "terminated")
        return _("The connection to Cockpit was lost: reload the page.");
    return message || escapeText(cockpit.message(error));
}

function byIndex(a, b) {
    return (a.Index ?? 0) - (b.Index ?? 0);
}

// The a{sv} of Sweep's options from the dialog's fields; only what was set.
export function sweepOptions({ scope, gpus, unit, container, graceSec, includeManagement, reason }, dryRun) {
    const options = { dry_run: cockpit.variant("b", !!dryRun) };
    if (scope === "gpus") {
        const indices = gpus.filter(g => typeof g === "number");
        const uuids = gpus.filter(g => typeof g === "string");
        // `gpus` takes indices (au); a MIG instance is chosen by its UUID (as), per the contract.
        if (uuids.length)
            options.gpus = cockpit.variant("as", [...indices.map(String), ...uuids]);
        else
            options.gpus = cockpit.variant("au", indices);
    } else if (scope === "unit") {
        options.unit = cockpit.variant("s", unit.trim());
    } else if (scope === "container") {
        options.container = cockpit.variant("s", container.trim());
    }
    if (graceSec !== "" && graceSec !== undefined && graceSec !== null)
        options.grace_ms = cockpit.variant("u", Math.round(Number(graceSec) * 1000));
    if (includeManagement)
        options.include_management = cockpit.variant("b", true);
    if (reason && reason.trim())
        options.reason = cockpit.variant("s", reason.trim());
    return options;
}

export class GuardModel {
    constructor() {
        cockpit.event_target(this);
        this.state = {
            daemon: "connecting", // connecting, running, stopped, not-running, not-installed, error
            daemonError: "",
            stoppedAt: null,
            manager: {},
            gpus: [],
            holders: null, // null until the first answer
            holdersError: "",
            history: null,
            historyError: "",
            events: [],
            running: null, // the sweep in progress: {id, scope, ended: [...], started}
            admin: null, // Cockpit's administrative access: null while unknown
        };
        this.client = null;
        this.seen = false;
        this.holdersSeq = 0;
        this.historySeq = 0;
        this.lastMemoryHint = 0;
        this.eventSeq = 0;

        this.permission = cockpit.permission({ admin: true });
        this.permission.addEventListener("changed", () => this.update({ admin: this.permission.allowed }));

        // gpuguardd coming and going: NameOwnerChanged on the bus itself, not a poll.
        this.bus = cockpit.dbus("org.freedesktop.DBus", { bus: "system" });
        this.bus.subscribe({
            path: "/org/freedesktop/DBus",
            interface: "org.freedesktop.DBus",
            member: "NameOwnerChanged",
            arg0: NAME,
        }, (path, iface, signal, args) => this.ownerChanged(args[0], args[2]));
        this.connect();
    }

    update(changes) {
        this.state = { ...this.state, ...changes };
        this.dispatchEvent("changed");
    }

    ownerChanged(name, owner) {
        if (name !== NAME)
            return;
        if (owner) {
            this.addEvent("info", _("gpuguardd started"));
            this.connect();
        } else {
            this.disconnect();
            this.addEvent("warning", _("gpuguardd stopped"));
            this.update({ daemon: "stopped", stoppedAt: Date.now(), gpus: [], holders: null, manager: {}, running: null });
        }
    }

    disconnect() {
        const client = this.client;
        this.client = null;
        if (client) {
            if (this.subscription)
                this.subscription.remove();
            client.close();
        }
    }

    connect() {
        this.disconnect();
        // superuser "try": with administrative access on, ListHolders shows every command line.
        const client = cockpit.dbus(NAME, { bus: "system", superuser: "try" });
        this.client = client;
        client.addEventListener("close", (event, options) => {
            if (this.client === client)
                this.closed(options);
        });
        this.manager = client.proxy(MANAGER_IFACE, MANAGER_PATH);
        this.manager.addEventListener("changed", () => this.readManager());
        this.gpuProxies = client.proxies(GPU_IFACE, MANAGER_PATH);
        this.gpuProxies.addEventListener("added", () => this.readGpus(true));
        this.gpuProxies.addEventListener("removed", () => this.readGpus(true));
        this.gpuProxies.addEventListener("changed", () => this.readGpus(false));
        this.subscription = client.subscribe({ interface: MANAGER_IFACE, path: MANAGER_PATH },
                                             (path, iface, signal, args) => this.onSignal(signal, args));
        this.manager.wait().then(() => {
            if (this.client !== client)
                return;
            if (!this.manager.valid) {
                this.update({ daemon: "error", daemonError: _("gpuguardd does not offer its manager interface.") });
                return;
            }
            this.seen = true;
            this.update({ daemon: "running", daemonError: "", stoppedAt: null });
            this.readManager();
            this.readGpus(true);
            this.refreshHistory();
        });
    }

    // The client closed: at start-up (the name has no owner), or the bridge went away.
    closed(options) {
        this.client = null;
        if (options.problem !== "not-found") {
            this.update({ daemon: "error", daemonError: cockpit.message(options), gpus: [], holders: null });
            return;
        }
        if (this.seen) {
            this.update({ daemon: "stopped", stoppedAt: this.state.stoppedAt || Date.now(), gpus: [], holders: null });
            return;
        }
        // Not running now: installed (D-Bus can activate it) or not there at all?
        this.bus.call("/org/freedesktop/DBus", "org.freedesktop.DBus", "ListActivatableNames", [])
                .then(([names]) => this.update({ daemon: names.includes(NAME) ? "not-running" : "not-installed" }))
                .catch(error => {
                    console.warn("ListActivatableNames failed:", error);
                    this.update({ daemon: "not-running" });
                });
    }

    readManager() {
        if (!this.manager || !this.manager.valid)
            return;
        const manager = unwrap(this.manager.data);
        this.update({ manager });
    }

    readGpus(structural) {
        const previous = new Map(this.state.gpus.map(g => [g.path, g]));
        const gpus = Object.keys(this.gpuProxies).filter(path => this.gpuProxies[path] && this.gpuProxies[path].valid)
                .map(path => ({ path, ...unwrap(this.gpuProxies[path].data) }))
                .sort(byIndex);
        let holdersMoved = structural;
        let memoryMoved = false;
        for (const gpu of gpus) {
            const old = previous.get(gpu.path);
            if (!old || old.HolderCount !== gpu.HolderCount || old.State !== gpu.State ||
                JSON.stringify(old.MigInstances) !== JSON.stringify(gpu.MigInstances))
                holdersMoved = true;
            else if (old.MemoryUsed !== gpu.MemoryUsed)
                memoryMoved = true;
        }
        this.update({ gpus });
        if (holdersMoved)
            this.refreshHolders();
        else if (memoryMoved)
            this.memoryHint();
    }

    // At most one ListHolders per MEMORY_HINT_MS for memory moves; the last move in a burst
    // is never dropped (it is asked about when the interval is over).
    memoryHint() {
        if (this.hintTimer)
            return;
        const wait = Math.max(0, this.lastMemoryHint + MEMORY_HINT_MS - Date.now());
        this.hintTimer = window.setTimeout(() => {
            this.hintTimer = null;
            this.lastMemoryHint = Date.now();
            this.refreshHolders();
        }, wait);
    }

    refreshHolders() {
        if (!this.client)
            return;
        const seq = ++this.holdersSeq;
        this.client.call(MANAGER_PATH, MANAGER_IFACE, "ListHolders", [{}], { timeout: 60000 })
                .then(([holders]) => {
                    if (seq === this.holdersSeq)
                        this.update({ holders: unwrap(holders).sort((a, b) => a.pid - b.pid), holdersError: "" });
                })
                .catch(error => {
                    if (seq === this.holdersSeq)
                        this.update({ holdersError: errorMessage(error) });
                });
    }

    refreshHistory() {
        if (!this.client)
            return;
        const seq = ++this.historySeq;
        this.client.call(MANAGER_PATH, MANAGER_IFACE, "GetHistory", [HISTORY_COUNT], { timeout: 60000 })
                .then(([reports]) => {
                    if (seq === this.historySeq)
                        this.update({ history: unwrap(reports), historyError: "" });
                })
                .catch(error => {
                    if (seq === this.historySeq)
                        this.update({ historyError: errorMessage(error) });
                });
    }

    addEvent(variant, text, extra) {
        const event = { key: ++this.eventSeq, time: Date.now(), variant, text, ...extra };
        this.update({ events: [event, ...this.state.events].slice(0, EVENTS_KEPT) });
    }

    onSignal(signal, rawArgs) {
        const args = escaped(rawArgs);
        if (signal === "SweepStarted") {
            const [id, scope] = args;
            this.update({ running: { id, scope: unwrap(scope), ended: [], started: Date.now() } });
            this.addEvent("info", cockpit.format(_("Sweep $0 started"), shortId(id)), { sweep: id, scope: unwrap(scope) });
        } else if (signal === "ProcessTerminated") {
            const [id, pid, comm, unit, sig] = args;
            const running = this.state.running;
            if (running && running.id === id)
                this.update({ running: { ...running, ended: [...running.ended, { pid, comm, unit, signal: sig }] } });
            const how = sig ? cockpit.format(_("after $0"), sig) : _("on its own");
            this.addEvent("success", cockpit.format(_("Process $0 ($1) ended $2"), pid, comm, how),
                          { sweep: id, pid, unit });
        } else if (signal === "SweepFinished") {
            const [id, outcome] = args;
            if (this.state.running && this.state.running.id === id)
                this.update({ running: null });
            this.addEvent(outcomeVariant(outcome), cockpit.format(_("Sweep $0 finished: $1"), shortId(id), outcomeText(outcome)),
                          { sweep: id });
            this.refreshHistory();
            this.refreshHolders();
        } else if (signal === "LeakSuspected") {
            const [gpu, uuid, bytes] = args;
            // A MIG instance leaks on its own: the signal names it by its MIG UUID.
            const text = String(uuid).startsWith("MIG-")
                ? cockpit.format(_("MIG instance $0 of GPU $1 keeps $2 with no process holding it"), uuid, gpu, formatBytes(bytes))
                : cockpit.format(_("GPU $0 keeps $1 with no process holding it"), gpu, formatBytes(bytes));
            this.addEvent("warning", text, { uuid });
        }
    }

    // A dry run: anyone may ask, through the page's ordinary client.
    preview(fields) {
        if (!this.client)
            return Promise.reject(new Error(_("gpuguardd is not running.")));
        return this.client.call(MANAGER_PATH, MANAGER_IFACE, "Sweep", [sweepOptions(fields, true)], { timeout: 120000 })
                .then(([report]) => unwrap(report));
    }

    // A GPU reset (ResetGpu), as a sweep: administrative access, a client of its own. The
    // command and the verification take minutes at most.
    resetGpu(index) {
        const client = cockpit.dbus(NAME, { bus: "system", superuser: "require" });
        return client.call(MANAGER_PATH, MANAGER_IFACE, "ResetGpu", [index, {}], { timeout: 15 * 60000 })
                .then(([report]) => unwrap(report))
                .finally(() => client.close());
    }

    // A real sweep: only through a client with administrative access (superuser "require"),
    // opened for this call and closed after it.
    sweep(fields) {
        const grace = fields.graceSec === "" || fields.graceSec === undefined ? DEFAULT_GRACE_MS : Number(fields.graceSec) * 1000;
        const client = cockpit.dbus(NAME, { bus: "system", superuser: "require" });
        return client.call(MANAGER_PATH, MANAGER_IFACE, "Sweep", [sweepOptions(fields, false)], { timeout: grace + SWEEP_SLACK_MS })
                .then(([report]) => unwrap(report))
                .finally(() => client.close());
    }
}

export function shortId(id) {
    return String(id || "").slice(0, 8);
}

export function formatBytes(bytes) {
    const value = Number(bytes) || 0;
    if (value >= 2 ** 30)
        return cockpit.format(_("$0 GiB"), (value / 2 ** 30).toFixed(1));
    if (value >= 2 ** 20)
        return cockpit.format(_("$0 MiB"), (value / 2 ** 20).toFixed(0));
    if (value >= 1024)
        return cockpit.format(_("$0 KiB"), (value / 1024).toFixed(0));
    return cockpit.format(_("$0 B"), value);
}

// A process's GPU memory: the contract's 0 means NVML does not say (it lists no such pid: its
// PIDs are the host's while gpuguardd runs in a container, or the process has no context), so
// it shows as unknown, never as "0 B" beside a GPU whose memory is in use.
export function processMemory(bytes) {
    return Number(bytes) ? formatBytes(bytes) : "—";
}

export function formatTime(ms) {
    if (!ms)
        return "";
    return new Date(ms).toLocaleString();
}

export function outcomeText(outcome) {
    const texts = {
        freed: _("freed"),
        "nothing-to-do": _("nothing to do"),
        survivors: _("survivors"),
        "memory-not-released": _("memory not released"),
        unverified: _("unverified"),
        "dry-run": _("dry run"),
        error: _("error"),
    };
    return texts[outcome] || outcome || _("unknown");
}

export function outcomeVariant(outcome) {
    if (outcome === "freed" || outcome === "nothing-to-do" || outcome === "dry-run")
        return "success";
    if (outcome === "error")
        return "danger";
    if (outcome === "survivors" || outcome === "memory-not-released" || outcome === "unverified")
        return "warning";
    return "info";
}

export function scopeText(scope) {
    if (!scope)
        return "";
    const parts = [];
    if (scope.gpus && scope.gpus.length)
        parts.push(cockpit.format(cockpit.ngettext("GPU $0", "GPUs $0", scope.gpus.length), scope.gpus.join(", ")));
    if (scope.mig && scope.mig.length)
        parts.push(cockpit.format(cockpit.ngettext("MIG instance $0", "MIG instances $0", scope.mig.length), scope.mig.join(", ")));
    if (scope.unit)
        parts.push(cockpit.format(_("unit $0"), scope.unit));
    if (scope.container)
        parts.push(cockpit.format(_("container $0"), scope.container));
    if (!parts.length)
        parts.push(_("all GPUs"));
    if (scope.include_management)
        parts.push(_("with management clients"));
    return parts.join(", ");
}
