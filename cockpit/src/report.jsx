// One sweep report (Sweep's reply, SweepFinished's, a GetHistory entry) in full: what the
// History rows open to and what the sweep dialog shows after a preview or a sweep.
import React from "react";
import { DescriptionList, DescriptionListDescription, DescriptionListGroup, DescriptionListTerm } from "@patternfly/react-core/dist/esm/components/DescriptionList/index.js";
import { Label } from "@patternfly/react-core/dist/esm/components/Label/index.js";
import { List, ListItem } from "@patternfly/react-core/dist/esm/components/List/index.js";
import { Title } from "@patternfly/react-core/dist/esm/components/Title/index.js";
import { Table, Tbody, Td, Th, Thead, Tr } from "@patternfly/react-table/dist/esm/components/Table/index.js";

import { formatBytes, formatTime, outcomeText, outcomeVariant, processMemory, scopeText } from "./model.js";

const _ = window.cockpit.gettext;
const cockpit = window.cockpit;

export function OutcomeLabel({ outcome }) {
    return <Label status={outcomeVariant(outcome)} className="gg-outcome">{outcomeText(outcome)}</Label>;
}

function gpuList(gpus) {
    return (gpus || []).join(", ");
}

// A compact table of one section of a report; nothing when the section is empty.
function Section({ title, rows, columns, id }) {
    if (!rows || !rows.length)
        return null;
    return (
        <div className="gg-report-section" data-section={id}>
            <Title headingLevel="h4" size="md">{title}</Title>
            <Table variant="compact" aria-label={title} borders>
                <Thead>
                    <Tr>{columns.map(([label]) => <Th key={label}>{label}</Th>)}</Tr>
                </Thead>
                <Tbody>
                    {rows.map((row, i) => (
                        <Tr key={i}>
                            {columns.map(([label, render]) => <Td key={label} dataLabel={label}>{render(row)}</Td>)}
                        </Tr>
                    ))}
                </Tbody>
            </Table>
        </div>
    );
}

export function ReportDetails({ report, plan }) {
    if (!report)
        return null;
    const pid = ["PID", r => r.pid];
    const comm = [_("Command"), r => r.comm];
    const unit = [_("Unit"), r => r.unit || "—"];
    return (
        <div className="gg-report" data-report-id={report.id}>
            <DescriptionList isHorizontal isCompact columnModifier={{ default: "2Col" }}>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Outcome")}</DescriptionListTerm>
                    <DescriptionListDescription>
                        <OutcomeLabel outcome={report.outcome} />
                        {" "}
                        {report.dry_run
                            ? _("a dry run: nothing was ended")
                            : report.verified ? _("memory release verified through NVML") : _("memory release not verified")}
                    </DescriptionListDescription>
                </DescriptionListGroup>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Scope")}</DescriptionListTerm>
                    <DescriptionListDescription>{scopeText(report.scope)}</DescriptionListDescription>
                </DescriptionListGroup>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Requested by")}</DescriptionListTerm>
                    <DescriptionListDescription>{report.requested_by || "—"}</DescriptionListDescription>
                </DescriptionListGroup>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Reason")}</DescriptionListTerm>
                    <DescriptionListDescription>{report.reason || "—"}</DescriptionListDescription>
                </DescriptionListGroup>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Started")}</DescriptionListTerm>
                    <DescriptionListDescription>
                        {formatTime((report.started_usec || 0) / 1000)}
                        {" "}
                        {cockpit.format(_("($0 ms)"), report.duration_ms ?? 0)}
                    </DescriptionListDescription>
                </DescriptionListGroup>
                <DescriptionListGroup>
                    <DescriptionListTerm>{_("Report")}</DescriptionListTerm>
                    <DescriptionListDescription className="gg-mono">{report.id}</DescriptionListDescription>
                </DescriptionListGroup>
                {report.error &&
                    <DescriptionListGroup>
                        <DescriptionListTerm>{_("Error")}</DescriptionListTerm>
                        <DescriptionListDescription>{report.error}</DescriptionListDescription>
                    </DescriptionListGroup>}
            </DescriptionList>
            <Section id="targets" title={plan ? _("Plan: processes the sweep would end") : _("Targets")}
                     rows={report.targets}
                     columns={[pid, comm, unit, [_("Container"), r => r.container || "—"], [_("Kind"), r => r.kind],
                         [_("GPUs"), r => gpuList(r.gpus)], [_("Memory"), r => processMemory(r.gpu_memory)],
                         [_("Executable"), r => r.exe]]} />
            <Section id="terminated" title={_("Terminated")} rows={report.terminated}
                     columns={[pid, comm, unit, [_("Signal"), r => r.signal || _("exited on its own")],
                         [_("Exited after"), r => cockpit.format(_("$0 ms"), r.exited_after_ms ?? 0)],
                         [_("Unreaped by"), r => r.zombie_parent ? String(r.zombie_parent) : "—"]]} />
            <Section id="survived" title={_("Survivors")} rows={report.survived}
                     columns={[pid, comm, unit, [_("State"), r => r.state], [_("Why"), r => r.why]]} />
            <Section id="spared" title={_("Spared")} rows={report.spared}
                     columns={[pid, comm, unit, [_("Why"), r => r.why]]} />
            <Section id="gpus" title={_("GPU memory")} rows={report.gpus}
                     columns={[["GPU", r => r.mig_uuid ? cockpit.format("$0 ($1)", r.index, r.mig_uuid) : r.index],
                         ["UUID", r => <span className="gg-mono">{r.uuid}</span>],
                         [report.dry_run ? _("In use") : _("Before"), r => formatBytes(r.memory_used_before)],
                         // A dry run ends nothing: no "after", nothing released.
                         ...(report.dry_run
                             ? []
                             : [[_("After"), r => formatBytes(r.memory_used_after)]]),
                         [_("Total"), r => formatBytes(r.memory_total)],
                         ...(report.dry_run ? [] : [[_("Released"), r => r.released ? _("yes") : _("no")]])]} />
            <Section id="leaks" title={_("Leaks")} rows={report.leaks}
                     columns={[["GPU", r => r.gpu], ["UUID", r => <span className="gg-mono">{r.uuid}</span>],
                         [_("Memory"), r => formatBytes(r.bytes)]]} />
            {report.warnings && report.warnings.length > 0 &&
                <div className="gg-report-section" data-section="warnings">
                    <Title headingLevel="h4" size="md">{_("Warnings")}</Title>
                    <List>{report.warnings.map((w, i) => <ListItem key={i}>{w}</ListItem>)}</List>
                </div>}
        </div>
    );
}
