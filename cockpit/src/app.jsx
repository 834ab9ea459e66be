// The page: daemon status, GPU cards, holders, the live event feed, history, the sweep dialog.
import React, { useEffect, useState } from "react";
import { Alert } from "@patternfly/react-core/dist/esm/components/Alert/index.js";
import { Button } from "@patternfly/react-core/dist/esm/components/Button/index.js";
import { Card, CardBody, CardTitle } from "@patternfly/react-core/dist/esm/components/Card/index.js";
import { EmptyState, EmptyStateBody } from "@patternfly/react-core/dist/esm/components/EmptyState/index.js";
import { Flex, FlexItem } from "@patternfly/react-core/dist/esm/layouts/Flex/index.js";
import { Label } from "@patternfly/react-core/dist/esm/components/Label/index.js";
import { PageSection } from "@patternfly/react-core/dist/esm/components/Page/index.js";
import { Spinner } from "@patternfly/react-core/dist/esm/components/Spinner/index.js";
import { Title } from "@patternfly/react-core/dist/esm/components/Title/index.js";
import { ExpandableRowContent, Table, Tbody, Td, Th, Thead, Tr } from "@patternfly/react-table/dist/esm/components/Table/index.js";

import { errorMessage, formatTime, scopeText, shortId } from "./model.js";
import { GpuCards } from "./gpus.jsx";
import { HoldersTable } from "./holders.jsx";
import { OutcomeLabel, ReportDetails } from "./report.jsx";
import { SweepDialog, adminReason } from "./sweep.jsx";

const _ = window.cockpit.gettext;
const cockpit = window.cockpit;

function useModel(model) {
    const [state, setState] = useState(model.state);
    useEffect(() => {
        const changed = () => setState(model.state);
        model.addEventListener("changed", changed);
        return () => model.removeEventListener("changed", changed);
    }, [model]);
    return state;
}

function DaemonStatus({ state }) {
    const { daemon, manager } = state;
    if (daemon === "connecting")
        return <EmptyState headingLevel="h2" titleText={_("Connecting to gpuguardd…")} icon={Spinner} className="gg-status" data-daemon={daemon} />;
    if (daemon === "not-installed")
        return (
            <Alert variant="danger" isInline className="gg-status" data-daemon={daemon}
                   title={_("gpuguard is not installed on this machine")}>
                {_("No D-Bus service org.gpuguard.GpuGuard1 is running or can be started. Install the gpuguard package (apt install gpuguard, or dnf install gpuguard), then reload this page.")}
            </Alert>
        );
    if (daemon === "not-running")
        return (
            <Alert variant="danger" isInline className="gg-status" data-daemon={daemon} title={_("gpuguardd is not running")}>
                {_("Start it with: systemctl start gpuguardd.service. This page connects as soon as it runs.")}
            </Alert>
        );
    if (daemon === "stopped")
        return (
            <Alert variant="warning" isInline className="gg-status" data-daemon={daemon}
                   title={cockpit.format(_("gpuguardd stopped at $0"), formatTime(state.stoppedAt))}>
                {_("The page reconnects by itself when gpuguardd runs again (systemctl start gpuguardd.service).")}
            </Alert>
        );
    if (daemon === "error")
        return <Alert variant="danger" isInline className="gg-status" data-daemon={daemon} title={_("Cannot talk to gpuguardd")}>{state.daemonError}</Alert>;
    // Without NVML but reading other GPUs (Vendors ["amd"]) the host works: NVML is NVIDIA's.
    if (manager.NvmlAvailable === false && !(manager.Vendors || []).length)
        return (
            <Alert variant="warning" isInline className="gg-status" data-daemon={daemon} title={_("NVML is not available")}>
                {cockpit.format(_("gpuguardd finds and ends holders through the device files, but cannot read GPU memory or verify its release: $0"), manager.NvmlError || "")}
            </Alert>
        );
    return null;
}

// Whether the daemon reads NVIDIA GPUs (Vendors; a gpuguardd from before it reads no other).
function nvidiaRead(manager) {
    return manager.Vendors === undefined || manager.Vendors.includes("nvidia") || !manager.Vendors.length;
}

function RunningSweep({ running, busy }) {
    if (!running && !busy)
        return null;
    return (
        <Alert variant="info" isInline className="gg-running" customIcon={<Spinner size="md" />}
               title={running ? cockpit.format(_("Sweep $0 running: $1"), shortId(running.id), scopeText(running.scope)) : _("A sweep is running")}>
            {running && cockpit.format(cockpit.ngettext("$0 process ended so far", "$0 processes ended so far", running.ended.length), running.ended.length)}
        </Alert>
    );
}

function EventFeed({ events }) {
    return (
        <Card className="gg-events" isCompact>
            <CardTitle component="h2">{_("Events")}</CardTitle>
            <CardBody>
                {events.length === 0
                    ? <div className="gg-muted">{_("Sweeps, ended processes and suspected leaks appear here as they happen.")}</div>
                    : <ul className="gg-event-list" aria-live="polite">
                        {events.map(e => (
                            <li key={e.key} className={`gg-event gg-event-${e.variant}`} data-pid={e.pid} data-sweep={e.sweep}>
                                <span className="gg-event-time">{new Date(e.time).toLocaleTimeString()}</span>
                                {" "}
                                <span className="gg-event-text">{e.text}</span>
                            </li>
                        ))}
                    </ul>}
            </CardBody>
        </Card>
    );
}

function History({ history, error }) {
    const [expanded, setExpanded] = useState({});
    if (error)
        return <Alert variant="danger" isInline title={error} />;
    if (history === null)
        return <Spinner size="lg" />;
    if (!history.length)
        return (
            <EmptyState headingLevel="h3" titleText={_("No sweeps yet")} variant="sm">
                <EmptyStateBody>{_("Every sweep, from this page, gpuguardctl or a unit's ExecStopPost hook, is kept here.")}</EmptyStateBody>
            </EmptyState>
        );
    const columns = [_("Started"), _("Outcome"), _("Scope"), _("Requested by"), _("Ended"), _("Survivors")];
    return (
        <Table aria-label={_("Sweep history")} variant="compact" className="gg-history">
            <Thead>
                <Tr>
                    <Th screenReaderText={_("Details")} />
                    {columns.map(c => <Th key={c}>{c}</Th>)}
                </Tr>
            </Thead>
            {history.map((report, rowIndex) => {
                const isExpanded = !!expanded[report.id];
                return (
                    <Tbody key={report.id} isExpanded={isExpanded} className="gg-history-row" data-report-id={report.id}>
                        <Tr>
                            <Td expand={{
                                rowIndex,
                                isExpanded,
                                onToggle: () => setExpanded(e => ({ ...e, [report.id]: !e[report.id] })),
                                expandId: "history-expand",
                            }} />
                            <Td dataLabel={columns[0]}>{formatTime((report.started_usec || 0) / 1000)}</Td>
                            <Td dataLabel={columns[1]}>
                                <OutcomeLabel outcome={report.outcome} />
                                {report.dry_run && report.outcome !== "dry-run" && <> <Label isCompact>{_("dry run")}</Label></>}
                            </Td>
                            <Td dataLabel={columns[2]}>{scopeText(report.scope)}</Td>
                            <Td dataLabel={columns[3]}>{report.requested_by}</Td>
                            <Td dataLabel={columns[4]}>{(report.terminated || []).length}</Td>
                            <Td dataLabel={columns[5]}>{(report.survived || []).length}</Td>
                        </Tr>
                        <Tr isExpanded={isExpanded}>
                            <Td colSpan={columns.length + 1}>
                                <ExpandableRowContent>{isExpanded && <ReportDetails report={report} />}</ExpandableRowContent>
                            </Td>
                        </Tr>
                    </Tbody>
                );
            })}
        </Table>
    );
}

// "Reset GPU…": asks first (a reset ends whatever still runs there), then the daemon decides
// (it refuses while anything holds the GPU); the outcome goes to the events.
function resetGpu(model, gpu) {
    if (!window.confirm(cockpit.format(_("Reset GPU $0? Its memory is freed; the daemon refuses while anything holds it."), gpu.Index)))
        return;
    model.resetGpu(gpu.Index)
            .then(report => model.addEvent(report.outcome === "reset" ? "success" : "warning",
                                           cockpit.format(_("GPU $0: $1 $2"), gpu.Index, report.outcome, report.error || "")))
            .catch(error => model.addEvent("danger", errorMessage(error)));
}

export function App({ model }) {
    const state = useModel(model);
    const [dialog, setDialog] = useState(false);
    const { manager, gpus } = state;
    const running = state.daemon === "running";
    const reason = adminReason(state.admin);
    return (
        <div className="gg-page">
            <PageSection className="gg-header">
                <Flex justifyContent={{ default: "justifyContentSpaceBetween" }} alignItems={{ default: "alignItemsCenter" }}>
                    <FlexItem>
                        <Title headingLevel="h1" size="2xl">{_("GPU Guard")}</Title>
                        {running &&
                            <div className="gg-muted gg-versions">
                                {nvidiaRead(manager)
                                    ? cockpit.format(_("gpuguardd $0, NVIDIA driver $1"), manager.Version || "?", manager.DriverVersion || _("unknown"))
                                    : cockpit.format(_("gpuguardd $0"), manager.Version || "?")}
                                {manager.Vendors && manager.Vendors.length > 0 &&
                                    <span className="gg-vendors">{cockpit.format(_(", GPUs: $0"), manager.Vendors.join(", "))}</span>}
                            </div>}
                    </FlexItem>
                    <FlexItem>
                        <Flex alignItems={{ default: "alignItemsCenter" }}>
                            {reason && running && <FlexItem className="gg-admin-note gg-muted">{reason}</FlexItem>}
                            <FlexItem>
                                <Button variant="primary" id="open-sweep" onClick={() => setDialog(true)} isDisabled={!running}>
                                    {_("Sweep…")}
                                </Button>
                            </FlexItem>
                        </Flex>
                    </FlexItem>
                </Flex>
            </PageSection>
            <PageSection className="gg-main">
                <DaemonStatus state={state} />
                <RunningSweep running={state.running} busy={running && manager.Busy} />
                {running &&
                    <>
                        <Title headingLevel="h2" className="gg-section-title">{_("GPUs")}</Title>
                        {gpus.length === 0
                            ? <EmptyState headingLevel="h3" titleText={_("No GPUs")} variant="sm" className="gg-no-gpus">
                                <EmptyStateBody>{manager.NvmlError || _("NVML lists no GPU on this machine.")}</EmptyStateBody>
                            </EmptyState>
                            : <GpuCards gpus={gpus} holders={state.holders} history={state.history} lastSweep={manager.LastSweep}
                                        onReset={state.admin ? gpu => resetGpu(model, gpu) : null} />}
                        <Title headingLevel="h2" className="gg-section-title">{_("Holders")}</Title>
                        {state.holdersError && <Alert variant="danger" isInline title={state.holdersError} />}
                        {state.holders === null && !state.holdersError
                            ? <Spinner size="lg" />
                            : <HoldersTable holders={state.holders} gpus={gpus} />}
                    </>}
                {(running || state.events.length > 0) && <EventFeed events={state.events} />}
                {(running || state.history) &&
                    <>
                        <Title headingLevel="h2" className="gg-section-title">{_("History")}</Title>
                        <History history={state.history} error={state.historyError} />
                    </>}
            </PageSection>
            {dialog && <SweepDialog model={model} gpus={gpus} admin={state.admin} onClose={() => setDialog(false)} />}
        </div>
    );
}
