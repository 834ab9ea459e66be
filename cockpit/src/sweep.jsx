// The sweep dialog: scope, grace, management clients, reason; Preview (a dry run, anyone)
// shows the plan, Sweep (administrative access only) runs it and shows the report.
import React, { useState } from "react";
import { Alert } from "@patternfly/react-core/dist/esm/components/Alert/index.js";
import { Button } from "@patternfly/react-core/dist/esm/components/Button/index.js";
import { Checkbox } from "@patternfly/react-core/dist/esm/components/Checkbox/index.js";
import { Form, FormGroup, FormHelperText } from "@patternfly/react-core/dist/esm/components/Form/index.js";
import { HelperText, HelperTextItem } from "@patternfly/react-core/dist/esm/components/HelperText/index.js";
import { Modal, ModalBody, ModalFooter, ModalHeader } from "@patternfly/react-core/dist/esm/components/Modal/index.js";
import { Radio } from "@patternfly/react-core/dist/esm/components/Radio/index.js";
import { TextInput } from "@patternfly/react-core/dist/esm/components/TextInput/index.js";

import { errorMessage, outcomeText } from "./model.js";
import { ReportDetails } from "./report.jsx";

const _ = window.cockpit.gettext;
const cockpit = window.cockpit;

export function adminReason(admin) {
    if (admin === null)
        return _("Checking for administrative access…");
    if (!admin)
        return _("Sweeping ends processes and needs administrative access, which is off: turn it on with the \"Limited access\" button in Cockpit's top bar. Preview works without it.");
    return "";
}

function validate(fields) {
    if (fields.scope === "gpus" && !fields.gpus.length)
        return _("Choose at least one GPU.");
    if (fields.scope === "unit" && !fields.unit.trim())
        return _("Enter a unit name.");
    if (fields.scope === "container" && !fields.container.trim())
        return _("Enter a container, e.g. lxc/129 or docker/3f2a9c1d.");
    if (fields.graceSec !== "" && !(Number(fields.graceSec) >= 0 && Number(fields.graceSec) <= 3600))
        return _("The grace period is a number of seconds from 0 to 3600.");
    return "";
}

export function SweepDialog({ model, gpus, admin, onClose }) {
    const [fields, setFields] = useState({
        scope: "all", gpus: [], unit: "", container: "", graceSec: "", includeManagement: false, reason: "",
    });
    const [busy, setBusy] = useState(null); // "preview" or "sweep" while a call runs
    const [result, setResult] = useState(null); // {report, plan}
    const [error, setError] = useState("");
    const set = (key) => (_event, value) => {
        setFields(f => ({ ...f, [key]: value }));
        setResult(null);
    };
    const setScope = (scope) => () => {
        setFields(f => ({ ...f, scope }));
        setResult(null);
    };
    const toggleGpu = (id) => (_event, checked) => {
        setFields(f => ({ ...f, gpus: checked ? [...f.gpus, id] : f.gpus.filter(g => g !== id) }));
        setResult(null);
    };

    const run = (kind) => {
        const invalid = validate(fields);
        if (invalid) {
            setError(invalid);
            return;
        }
        setError("");
        setResult(null);
        setBusy(kind);
        const call = kind === "preview" ? model.preview(fields) : model.sweep(fields);
        call.then(report => setResult({ report, plan: kind === "preview" }))
                .catch(err => setError(errorMessage(err)))
                .finally(() => setBusy(null));
    };

    const reason = adminReason(admin);
    const done = result && !result.plan;
    return (
        <Modal isOpen onClose={onClose} variant="large" aria-labelledby="sweep-dialog-title" className="gg-sweep-dialog">
            <ModalHeader title={_("Sweep GPUs")} labelId="sweep-dialog-title"
                         description={_("End the compute processes holding GPUs: SIGTERM, the grace period, then SIGKILL; then verify through NVML that the memory came back.")} />
            <ModalBody>
                <Form onSubmit={e => { e.preventDefault(); run("preview") }}>
                    <FormGroup role="radiogroup" isInline fieldId="sweep-scope" label={_("Scope")}>
                        <Radio id="scope-all" name="scope" label={_("All GPUs")} isChecked={fields.scope === "all"} onChange={setScope("all")} />
                        <Radio id="scope-gpus" name="scope" label={_("GPUs")} isChecked={fields.scope === "gpus"} onChange={setScope("gpus")} />
                        <Radio id="scope-unit" name="scope" label={_("Unit")} isChecked={fields.scope === "unit"} onChange={setScope("unit")} />
                        <Radio id="scope-container" name="scope" label={_("Container")} isChecked={fields.scope === "container"} onChange={setScope("container")} />
                    </FormGroup>
                    {fields.scope === "gpus" &&
                        <FormGroup isInline fieldId="sweep-gpus" label={_("GPUs")}>
                            {gpus.map(g => (
                                <React.Fragment key={g.path}>
                                    <Checkbox id={`sweep-gpu-${g.Index}`} label={cockpit.format(_("GPU $0: $1"), g.Index, g.Name)}
                                              isChecked={fields.gpus.includes(g.Index)} onChange={toggleGpu(g.Index)} />
                                    {(g.MigInstances || []).map(mig => (
                                        <Checkbox key={mig.uuid} id={`sweep-mig-${mig.uuid}`} label={cockpit.format(_("MIG $0"), mig.uuid)}
                                                  isChecked={fields.gpus.includes(mig.uuid)} onChange={toggleGpu(mig.uuid)} />
                                    ))}
                                </React.Fragment>
                            ))}
                        </FormGroup>}
                    {fields.scope === "unit" &&
                        <FormGroup fieldId="sweep-unit" label={_("Unit")}>
                            <TextInput id="sweep-unit" value={fields.unit} onChange={set("unit")} placeholder="sglang-qwen.service" />
                        </FormGroup>}
                    {fields.scope === "container" &&
                        <FormGroup fieldId="sweep-container" label={_("Container")}>
                            <TextInput id="sweep-container" value={fields.container} onChange={set("container")} placeholder="lxc/129" />
                        </FormGroup>}
                    <FormGroup fieldId="sweep-grace" label={_("Grace period (seconds)")}>
                        <TextInput id="sweep-grace" type="number" min="0" max="3600" value={fields.graceSec} onChange={set("graceSec")}
                                   placeholder={_("the daemon's GraceSec")} />
                        <FormHelperText>
                            <HelperText><HelperTextItem>{_("Time between SIGTERM and SIGKILL.")}</HelperTextItem></HelperText>
                        </FormHelperText>
                    </FormGroup>
                    <FormGroup fieldId="sweep-management">
                        <Checkbox id="sweep-management" label={_("Also end management clients (nvidia-smi, exporters)")}
                                  isChecked={fields.includeManagement} onChange={set("includeManagement")} />
                    </FormGroup>
                    <FormGroup fieldId="sweep-reason" label={_("Reason")}>
                        <TextInput id="sweep-reason" value={fields.reason} onChange={set("reason")}
                                   placeholder={_("recorded in the report and the journal")} />
                    </FormGroup>
                </Form>
                {error && <Alert variant="danger" isInline title={error} className="gg-dialog-error" />}
                {busy === "sweep" && <Alert variant="info" isInline title={_("Sweeping… the event feed shows each process as it ends.")} />}
                {result &&
                    <div className="gg-dialog-result">
                        {result.plan
                            ? <Alert variant="info" isInline className="gg-plan-summary"
                                     title={cockpit.format(cockpit.ngettext("Preview: the sweep would end $0 process; nothing was ended.",
                                                                            "Preview: the sweep would end $0 processes; nothing was ended.",
                                                                            (result.report.targets || []).length),
                                                           (result.report.targets || []).length)} />
                            : <Alert variant={result.report.outcome === "freed" || result.report.outcome === "nothing-to-do" ? "success" : "warning"}
                                     isInline className="gg-sweep-summary"
                                     title={cockpit.format(_("Sweep finished: $0"), outcomeText(result.report.outcome))} />}
                        <ReportDetails report={result.report} plan={result.plan} />
                    </div>}
            </ModalBody>
            <ModalFooter>
                {!done &&
                    <Button variant="danger" id="sweep-run" onClick={() => run("sweep")}
                            isDisabled={!admin || !!busy} isLoading={busy === "sweep"}
                            aria-describedby={reason ? "sweep-disabled-why" : undefined}>
                        {_("Sweep")}
                    </Button>}
                {!done &&
                    <Button variant="secondary" id="sweep-preview" onClick={() => run("preview")} isDisabled={!!busy}
                            isLoading={busy === "preview"}>
                        {_("Preview")}
                    </Button>}
                <Button variant="link" id="sweep-close" onClick={onClose}>{done ? _("Close") : _("Cancel")}</Button>
                {reason && !done && <span id="sweep-disabled-why" className="gg-disabled-why">{reason}</span>}
            </ModalFooter>
        </Modal>
    );
}
