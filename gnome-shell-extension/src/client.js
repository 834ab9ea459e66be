// gpuguardd's D-Bus state, as gnome-shell's own power-profiles indicator reads its service
// (js/ui/status/powerProfiles.js): Gio.DBusProxy objects on the system bus, kept current by
// PropertiesChanged, and the bus name's owner watched so that the indicator greys out while
// gpuguardd is away and comes back with it. No polling: holders (a method, ListHolders) are
// listed when a GPU's HolderCount changes or the menu opens.

import Gio from 'gi://Gio';
import GLib from 'gi://GLib';

import {endedOf, gpuTitle, sweepLeftBehind} from './state.js';

export const BUS_NAME = 'org.gpuguard.GpuGuard1';
const MANAGER_PATH = '/org/gpuguard/GpuGuard1';
const MANAGER = 'org.gpuguard.GpuGuard1.Manager';
const GPU = 'org.gpuguard.GpuGuard1.Gpu';
// The pids whose owners are remembered (for "a sweep ended your process"): enough for any
// workstation, and a bound on what a flood of short-lived holders can make us keep.
const KNOWN_MAX = 4096;

function unpack(proxy, name, fallback) {
    const value = proxy?.get_cached_property(name);
    return value ? value.recursiveUnpack() : fallback;
}

export class GpuGuardClient {
    // interfaceXml: the contract (dbus/org.gpuguard.GpuGuard1.xml, shipped in the extension).
    // onChange(): something shown changed. onEvent(kind, data): 'leak' {gpu, uuid, bytes, title},
    // 'left-behind' {report}, 'ended-mine' {report, ended}.
    constructor(interfaceXml, onChange, onEvent) {
        const node = Gio.DBusNodeInfo.new_for_xml(interfaceXml);
        this._managerInfo = node.lookup_interface(MANAGER);
        this._gpuInfo = node.lookup_interface(GPU);
        this._onChange = onChange;
        this._onEvent = onEvent;
        this._cancellable = new Gio.Cancellable();
        this._manager = null;
        this._gpus = [];
        this._handlers = [];  // [object, handler id]: disconnected by destroy()
        this.holders = [];
        this._known = new Map();  // pid -> {uid, comm} of holders seen
        this._listing = false;
        this._listAgain = false;
        this.uid = new Gio.Credentials().get_unix_user();
    }

    start() {
        Gio.DBusProxy.new(Gio.DBus.system, Gio.DBusProxyFlags.DO_NOT_AUTO_START,
            this._managerInfo, BUS_NAME, MANAGER_PATH, MANAGER, this._cancellable,
            (_source, result) => {
                try {
                    this._manager = Gio.DBusProxy.new_finish(result);
                } catch (e) {
                    if (!e.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED))
                        logError(e, 'gpuguard: no proxy for gpuguardd');
                    return;
                }
                this._connect(this._manager, 'notify::g-name-owner', () => this._ownerChanged());
                this._connect(this._manager, 'g-properties-changed', (_p, changed) => {
                    const keys = changed.deepUnpack();
                    if ('GpuCount' in keys)
                        this._syncGpus();
                    this._onChange();
                });
                this._connect(this._manager, 'g-signal', (_p, _sender, name, params) =>
                    this._signal(name, params));
                this._ownerChanged();
            });
    }

    _connect(object, signal, handler) {
        this._handlers.push([object, object.connect(signal, handler)]);
    }

    destroy() {
        this._cancellable.cancel();
        for (const [object, id] of this._handlers)
            object.disconnect(id);
        this._handlers = [];
        this._manager = null;
        this._gpus = [];
    }

    get onBus() {
        return Boolean(this._manager?.g_name_owner);
    }

    get busy() {
        return Boolean(unpack(this._manager, 'Busy', false));
    }

    get lastSweep() {
        return unpack(this._manager, 'LastSweep', {});
    }

    // One record per GPU object: index, vendor, name, memory_total, memory_used, holder_count,
    // state. No Vendor: a gpuguardd from before vendors, which reads NVIDIA GPUs only.
    get gpus() {
        if (!this.onBus)
            return [];
        return this._gpus.map((proxy, index) => ({
            index: unpack(proxy, 'Index', index),
            vendor: unpack(proxy, 'Vendor', 'nvidia'),
            name: unpack(proxy, 'Name', ''),
            memory_total: unpack(proxy, 'MemoryTotal', 0),
            memory_used: unpack(proxy, 'MemoryUsed', 0),
            holder_count: unpack(proxy, 'HolderCount', 0),
            state: unpack(proxy, 'State', 'unknown'),
        }));
    }

    _ownerChanged() {
        if (this.onBus) {
            this._syncGpus();
            this.refreshHolders();
        } else {
            this._gpus = [];
            this.holders = [];
        }
        this._onChange();
    }

    // A proxy per GPU object /gpu/0 .. /gpu/<GpuCount - 1>, made again when the count changes.
    _syncGpus() {
        const count = this.onBus ? Number(unpack(this._manager, 'GpuCount', 0)) : 0;
        if (count === this._gpus.length)
            return;
        this._gpus = [];
        for (let index = 0; index < count; index++) {
            const proxy = new Gio.DBusProxy({
                g_connection: Gio.DBus.system,
                g_name: BUS_NAME,
                g_object_path: `${MANAGER_PATH}/gpu/${index}`,
                g_interface_name: GPU,
                g_interface_info: this._gpuInfo,
                g_flags: Gio.DBusProxyFlags.DO_NOT_AUTO_START,
            });
            this._gpus.push(proxy);
            proxy.init_async(GLib.PRIORITY_DEFAULT, this._cancellable, (_p, result) => {
                try {
                    proxy.init_finish(result);
                } catch (e) {
                    if (!e.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED))
                        logError(e, `gpuguard: GPU ${index}`);
                    return;
                }
                this._connect(proxy, 'g-properties-changed', (_q, changed) => {
                    if ('HolderCount' in changed.deepUnpack())
                        this.refreshHolders();
                    this._onChange();
                });
                this._onChange();
            });
        }
    }

    // ListHolders, one call at a time: a request while one runs is served by one more after it.
    refreshHolders() {
        if (!this.onBus)
            return;
        if (this._listing) {
            this._listAgain = true;
            return;
        }
        this._listing = true;
        this._manager.call('ListHolders', new GLib.Variant('(a{sv})', [{}]),
            Gio.DBusCallFlags.NONE, -1, this._cancellable, (proxy, result) => {
                this._listing = false;
                try {
                    [this.holders] = proxy.call_finish(result).recursiveUnpack();
                } catch (e) {
                    if (e.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED))
                        return;
                    this.holders = [];
                }
                for (const holder of this.holders) {
                    this._known.delete(holder.pid);
                    this._known.set(holder.pid, {uid: holder.uid, comm: holder.comm});
                }
                while (this._known.size > KNOWN_MAX)
                    this._known.delete(this._known.keys().next().value);
                this._onChange();
                if (this._listAgain) {
                    this._listAgain = false;
                    this.refreshHolders();
                }
            });
    }

    _signal(name, params) {
        if (name === 'LeakSuspected') {
            const [gpu, uuid, bytes] = params.recursiveUnpack();
            // Its vendor and name, from its object (title: escaped, or '' when not listed).
            const listed = this.gpus.find(g => g.index === gpu);
            this._onEvent('leak', {gpu, uuid, bytes, title: listed ? gpuTitle(listed) : ''});
        } else if (name === 'SweepFinished') {
            const [, , report] = params.recursiveUnpack();
            if (report.dry_run)
                return;
            if (sweepLeftBehind(report))
                this._onEvent('left-behind', {report});
            const ended = endedOf(report, this._known, this.uid);
            if (ended.length)
                this._onEvent('ended-mine', {report, ended});
        }
    }

    // Sweep (or its dry run) of GPU `index`; callback(report, error). A real sweep may ask
    // for authentication: polkit asks through the shell's own agent.
    sweep(index, dryRun, callback) {
        const options = {
            gpus: new GLib.Variant('au', [index]),
            dry_run: new GLib.Variant('b', dryRun),
            reason: new GLib.Variant('s', 'GNOME Shell extension'),
        };
        this._ask('Sweep', new GLib.Variant('(a{sv})', [options]), callback);
    }

    // ResetGpu of GPU `index` (its own polkit action, auth_admin: asked every time);
    // callback(report, error).
    reset(index, callback) {
        const options = {reason: new GLib.Variant('s', 'GNOME Shell extension')};
        this._ask('ResetGpu', new GLib.Variant('(ua{sv})', [index, options]), callback);
    }

    // A Manager call that may ask for authentication (polkit asks through the shell's own
    // agent), with no timeout of its own: a sweep or a reset takes as long as it takes.
    _ask(method, parameters, callback) {
        this._manager.call(method, parameters,
            Gio.DBusCallFlags.ALLOW_INTERACTIVE_AUTHORIZATION, 2 ** 31 - 1, this._cancellable,
            (proxy, result) => {
                let report = null, error = null;
                try {
                    [report] = proxy.call_finish(result).recursiveUnpack();
                } catch (e) {
                    if (e.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED))
                        return;
                    error = e;
                }
                callback(report, error);
            });
    }
}

// Whether a failed call was a refusal (polkit said no, or the bus policy did).
export function isRefusal(error) {
    const remote = Gio.DBusError.get_remote_error(error) ?? '';
    return remote === 'org.gpuguard.GpuGuard1.Error.NotAuthorized' ||
        remote === 'org.freedesktop.DBus.Error.AccessDenied';
}

// The message of a failed call without GDBus's "GDBus.Error:<name>: " prefix.
export function errorText(error) {
    return String(error.message ?? error).replace(/^GDBus\.Error:[^\s:]+(:\s*)?/, '');
}
