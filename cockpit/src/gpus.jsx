// The GPU cards: vendor, name, UUID, state, memory, holders by kind, the last sweep, MIG instances.
import React from "react";
import { Button } from "@patternfly/react-core/dist/esm/components/Button/index.js";
import { Card, CardBody, CardHeader, CardTitle } from "@patternfly/react-core/dist/esm/components/Card/index.js";
import { Gallery } from "@patternfly/react-core/dist/esm/layouts/Gallery/index.js";
import { Label } from "@patternfly/react-core/dist/esm/components/Label/index.js";
import { Progress, ProgressMeasureLocation } from "@patternfly/react-core/dist/esm/components/Progress/index.js";
import { List, ListItem } from "@patternfly/react-core/dist/esm/components/List/index.js";

import { formatBytes, formatTime } from "./model.js";
import { OutcomeLabel } from "./report.jsx";

const _ = window.cockpit.gettext;
const cockpit = window.cockpit;

const STATES = {
    idle: { color: "green", text: () => _("No process holds this GPU.") },
    "in-use": { color: "blue", text: () => _("Processes hold this GPU, or NVML lists processes on it.") },
    leaked: { color: "orange", text: () => _("Memory is in use but no process holds it: a leak.") },
    lost: { color: "red", text: () => _("NVML says this GPU fell off the bus.") },
    unknown: { color: "grey", text: () => _("gpuguardd cannot read this GPU's state.") },
};

export function stateInfo(state) {
    return STATES[state] || STATES.unknown;
}

// Whose GPU it is (the Vendor property: "nvidia", "amd"). A gpuguardd from before vendors
// has no Vendor and reads NVIDIA GPUs only. A value a later gpuguardd adds is shown as it
// came (escaped, as every string from the bus: model.js unwrap).
const VENDORS = { nvidia: "NVIDIA", amd: "AMD" };

export function vendorOf(gpu) {
    return gpu.Vendor === undefined ? "nvidia" : gpu.Vendor;
}

function VendorLabel({ gpu }) {
    const vendor = vendorOf(gpu);
    return <Label isCompact variant="outline" className="gg-vendor" data-vendor={vendor}>{VENDORS[vendor] || vendor}</Label>;
}

export function StateLabel({ state }) {
    return <Label color={stateInfo(state).color} className="gg-state">{state || "unknown"}</Label>;
}

function MemoryBar({ used, total, title }) {
    const percent = total ? Math.min(100, (100 * used) / total) : 0;
    return (
        <Progress value={percent} size="sm"
                  measureLocation={ProgressMeasureLocation.outside}
                  label={cockpit.format(_("$0 of $1"), formatBytes(used), formatBytes(total))}
                  variant={percent > 90 ? "warning" : undefined}
                  aria-label={cockpit.format(_("$0 memory in use"), title)} />
    );
}

function holderKinds(holders, index) {
    const mine = (holders || []).filter(h => (h.gpus || []).includes(index));
    const counts = {};
    for (const h of mine)
        counts[h.kind] = (counts[h.kind] || 0) + 1;
    const protectedCount = mine.filter(h => h.protected).length;
    const parts = Object.keys(counts).sort().map(kind => cockpit.format("$0 $1", counts[kind], kind));
    if (protectedCount)
        parts.push(cockpit.format(_("$0 protected"), protectedCount));
    return parts.join(", ");
}

// The newest report that swept this GPU (its `gpus` entry names it).
function lastSweepOf(history, lastSweep, index) {
    const reports = [...(history || [])];
    if (lastSweep && lastSweep.id && !reports.some(r => r.id === lastSweep.id))
        reports.unshift(lastSweep);
    for (const report of reports) {
        if (report.dry_run)
            continue;
        const entry = (report.gpus || []).find(g => g.index === index && !g.mig_uuid);
        if (entry)
            return { report, entry };
    }
    return null;
}

// The start gate's verdict (FreeSinceUsec, WaitingOn: gpuguardd judges it, as for
// `gpuguardctl wait`): "free for N s", ticking, or what the GPU waits on. Nothing from a
// daemon older than the gate.
function Readiness({ gpu }) {
    const since = gpu.FreeSinceUsec || 0;
    const [now, setNow] = React.useState(Date.now());
    React.useEffect(() => {
        if (!since)
            return undefined;
        setNow(Date.now());
        const timer = window.setInterval(() => setNow(Date.now()), 1000);
        return () => window.clearInterval(timer);
    }, [since]);
    if (gpu.FreeSinceUsec === undefined && gpu.WaitingOn === undefined)
        return null;
    const waits = gpu.WaitingOn || [];
    return (
        <>
            <div className="gg-card-label">{_("Next job")}</div>
            <div className="gg-readiness" data-free={since ? "true" : "false"}>
                {since
                    ? cockpit.format(_("free for $0 s"), Math.max(0, Math.floor((now - since / 1000) / 1000)))
                    : cockpit.format(_("waiting on: $0"), waits.join("; ") || _("nothing known yet"))}
            </div>
        </>
    );
}

function MigInstances({ instances }) {
    if (!instances || !instances.length)
        return null;
    return (
        <div className="gg-mig" data-mig-count={instances.length}>
            <div className="gg-card-label">{_("MIG instances")}</div>
            <List isPlain>
                {instances.map(mig => (
                    <ListItem key={mig.uuid} className="gg-mig-instance">
                        <div>
                            <span className="gg-mono">{mig.uuid}</span>
                            {" "}
                            <StateLabel state={mig.state} />
                            {mig.leak_kind && <span className="gg-leak-kind gg-muted"> {mig.leak_kind}</span>}
                        </div>
                        <div className="gg-muted">
                            {cockpit.format(_("GPU instance $0, compute instance $1"), mig.gpu_instance_id, mig.compute_instance_id)}
                            {", "}
                            <span className="gg-mig-holders">
                                {cockpit.format(cockpit.ngettext("$0 holder", "$0 holders", mig.holder_count ?? 0), mig.holder_count ?? 0)}
                            </span>
                        </div>
                        <MemoryBar used={mig.memory_used} total={mig.memory_total} title={mig.uuid} />
                    </ListItem>
                ))}
            </List>
        </div>
    );
}

export function GpuCards({ gpus, holders, history, lastSweep, onReset }) {
    return (
        <Gallery hasGutter minWidths={{ default: "22rem" }} className="gg-gpus">
            {gpus.map(gpu => {
                const info = stateInfo(gpu.State);
                const kinds = holderKinds(holders, gpu.Index);
                const last = lastSweepOf(history, lastSweep, gpu.Index);
                const title = cockpit.format(_("GPU $0"), gpu.Index);
                return (
                    <Card key={gpu.path} className="gg-gpu" data-index={gpu.Index} data-state={gpu.State} isCompact
                          component="section" aria-label={title}>
                        <CardHeader actions={{ actions: <StateLabel state={gpu.State} />, hasNoOffset: true }}>
                            <CardTitle component="h3">
                                {title}: <VendorLabel gpu={gpu} /> <span className="gg-gpu-name">{gpu.Name}</span>
                            </CardTitle>
                        </CardHeader>
                        <CardBody>
                            <div className="gg-mono gg-muted gg-uuid">{gpu.Uuid}</div>
                            <div className="gg-state-text">{info.text()}</div>
                            {gpu.LeakKind && <div className="gg-leak-kind">{cockpit.format(_("Leak kind: $0"), gpu.LeakKind)}</div>}
                            {/* Where a reset may help: a leak on a whole GPU; the daemon refuses if anything holds it. */}
                            {onReset && gpu.State === "leaked" && !gpu.MigMode &&
                                <Button variant="secondary" size="sm" className="gg-reset" onClick={() => onReset(gpu)}>{_("Reset GPU…")}</Button>}
                            {gpu.Error && <div className="gg-error-text">{gpu.Error}</div>}
                            <div className="gg-card-label">{_("Memory")}</div>
                            {/* An unknown GPU's memory figures mean nothing (the daemon could not read them). */}
                            {gpu.State === "unknown" || !gpu.MemoryTotal
                                ? <div className="gg-memory-unknown gg-muted">{_("unknown")}</div>
                                : <MemoryBar used={gpu.MemoryUsed} total={gpu.MemoryTotal} title={title} />}
                            <div className="gg-card-label">{_("Holders")}</div>
                            <div className="gg-holder-kinds">
                                {cockpit.format(cockpit.ngettext("$0 process", "$0 processes", gpu.HolderCount ?? 0), gpu.HolderCount ?? 0)}
                                {kinds && `: ${kinds}`}
                            </div>
                            <Readiness gpu={gpu} />
                            <div className="gg-card-label">{_("Last sweep")}</div>
                            <div className="gg-last-sweep">
                                {last
                                    ? <>
                                        <OutcomeLabel outcome={last.report.outcome} />
                                        {" "}
                                        {formatTime((last.report.started_usec || 0) / 1000)}
                                        {", "}
                                        {last.entry.released ? _("memory released") : _("memory not released")}
                                    </>
                                    : _("never swept")}
                            </div>
                            {gpu.MigMode && <div className="gg-card-label">{_("MIG mode on")}</div>}
                            <MigInstances instances={gpu.MigInstances} />
                        </CardBody>
                    </Card>
                );
            })}
        </Gallery>
    );
}
