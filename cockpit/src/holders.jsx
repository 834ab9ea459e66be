// The holders table, filtered by GPU, unit and container on the page (ListHolders' answer).
import React, { useState } from "react";
import { EmptyState, EmptyStateBody } from "@patternfly/react-core/dist/esm/components/EmptyState/index.js";
import { FormSelect, FormSelectOption } from "@patternfly/react-core/dist/esm/components/FormSelect/index.js";
import { Label } from "@patternfly/react-core/dist/esm/components/Label/index.js";
import { TextInput } from "@patternfly/react-core/dist/esm/components/TextInput/index.js";
import { Toolbar, ToolbarContent, ToolbarItem } from "@patternfly/react-core/dist/esm/components/Toolbar/index.js";
import { Table, Tbody, Td, Th, Thead, Tr } from "@patternfly/react-table/dist/esm/components/Table/index.js";

import { processMemory } from "./model.js";

const _ = window.cockpit.gettext;
const cockpit = window.cockpit;

function matches(holder, { gpu, unit, container }) {
    if (gpu !== "" && !(holder.gpus || []).includes(Number(gpu)))
        return false;
    if (unit && !(holder.unit || "").toLowerCase().includes(unit.toLowerCase()))
        return false;
    if (container && !(holder.container || "").toLowerCase().includes(container.toLowerCase()))
        return false;
    return true;
}

export function HoldersTable({ holders, gpus }) {
    const [filter, setFilter] = useState({ gpu: "", unit: "", container: "" });
    const set = (key) => (_event, value) => setFilter(f => ({ ...f, [key]: value }));
    const shown = (holders || []).filter(h => matches(h, filter));
    const columns = [_("PID"), _("User"), _("Unit"), _("Container"), _("Kind"), _("GPUs"), _("Memory"),
        _("How found"), _("Command")];
    return (
        <>
            <Toolbar className="gg-holder-filters">
                <ToolbarContent>
                    <ToolbarItem>
                        <FormSelect value={filter.gpu} onChange={set("gpu")} aria-label={_("Filter by GPU")} id="filter-gpu">
                            <FormSelectOption value="" label={_("All GPUs")} />
                            {gpus.map(g => <FormSelectOption key={g.Index} value={String(g.Index)}
                                                             label={cockpit.format(_("GPU $0"), g.Index)} />)}
                        </FormSelect>
                    </ToolbarItem>
                    <ToolbarItem>
                        <TextInput type="search" value={filter.unit} onChange={set("unit")} id="filter-unit"
                                   placeholder={_("Filter by unit")} aria-label={_("Filter by unit")} />
                    </ToolbarItem>
                    <ToolbarItem>
                        <TextInput type="search" value={filter.container} onChange={set("container")} id="filter-container"
                                   placeholder={_("Filter by container")} aria-label={_("Filter by container")} />
                    </ToolbarItem>
                </ToolbarContent>
            </Toolbar>
            {shown.length === 0
                ? <EmptyState headingLevel="h3" titleText={holders && holders.length ? _("No holder matches the filter") : _("No process holds a GPU")}
                              variant="sm" className="gg-holders-empty">
                    <EmptyStateBody>{_("Processes that open the GPUs' device files or that NVML lists appear here as they come.")}</EmptyStateBody>
                </EmptyState>
                : <Table variant="compact" aria-label={_("Holders")} className="gg-holders">
                    <Thead>
                        <Tr>{columns.map(c => <Th key={c} modifier="wrap">{c}</Th>)}</Tr>
                    </Thead>
                    <Tbody>
                        {shown.map(h => (
                            <Tr key={h.pid} data-pid={h.pid} className={h.protected ? "gg-protected" : undefined}>
                                <Td dataLabel={columns[0]}>{h.pid}</Td>
                                <Td dataLabel={columns[1]}>{h.user || String(h.uid)}</Td>
                                <Td dataLabel={columns[2]}>{h.unit || "—"}</Td>
                                <Td dataLabel={columns[3]}>{h.container || "—"}</Td>
                                <Td dataLabel={columns[4]}>
                                    {h.kind}
                                    {h.protected &&
                                        <div className="gg-protected-why">
                                            <Label color="purple" isCompact>{_("protected")}</Label>{" "}{h.protected_why}
                                        </div>}
                                </Td>
                                <Td dataLabel={columns[5]}>{[...(h.gpus || []), ...(h.mig || [])].join(", ")}</Td>
                                <Td dataLabel={columns[6]} modifier="nowrap">{processMemory(h.gpu_memory)}</Td>
                                <Td dataLabel={columns[7]}>{(h.how || []).join(", ")}</Td>
                                <Td dataLabel={columns[8]} className="gg-command" modifier="breakWord">
                                    {h.cmdline || h.exe || h.comm}
                                </Td>
                            </Tr>
                        ))}
                    </Tbody>
                </Table>}
        </>
    );
}
