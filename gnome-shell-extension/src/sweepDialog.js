// "Sweep GPU N…": the dry run's plan first (anyone may ask for it), then, if the user goes
// on, the sweep itself through the bus. polkit asks for authentication through the shell's
// own agent (the call allows interactive authorization); a refusal is shown as one.

import GObject from 'gi://GObject';
import St from 'gi://St';

import {isRefusal, errorText} from './client.js';
import {_, Dialog, ModalDialog, ngettext} from './compat.js';
import {escapeText} from './escape.js';
import {format, formatBytes} from './state.js';

const SHOWN_MAX = 12;  // plan lines shown; the rest are counted

// (the dialog's description, the plan's lines) for a dry run's report.
function plan(report) {
    const targets = report.targets ?? [];
    if (!targets.length)
        return [_('Nothing to end: no process holds this GPU that a sweep would touch.'), ''];
    const lines = targets.slice(0, SHOWN_MAX).map(t => [
        format(_('%s (PID %d)'), escapeText(t.comm ?? ''), t.pid),
        escapeText(t.container || t.unit || ''),
        Number(t.gpu_memory) ? formatBytes(t.gpu_memory) : '',
    ].filter(Boolean).join(' · '));
    if (targets.length > SHOWN_MAX)
        lines.push(format(_('… and %d more'), targets.length - SHOWN_MAX));
    const spared = (report.spared ?? []).length;
    if (spared)
        lines.push(format(ngettext('%d protected process is left alone.',
            '%d protected processes are left alone.', spared), spared));
    return [_('These processes will be ended (SIGTERM, then SIGKILL):'), lines.join('\n')];
}

function resultText(report) {
    const ended = (report.terminated ?? []).length;
    const survived = (report.survived ?? []).length;
    switch (report.outcome) {
    case 'freed':
        return format(ngettext('Done: %d process ended, memory freed.',
            'Done: %d processes ended, memory freed.', ended), ended);
    case 'nothing-to-do':
        return _('Nothing to do.');
    case 'survivors':
        return format(ngettext('%d process survived the sweep.',
            '%d processes survived the sweep.', survived), survived);
    case 'memory-not-released':
        return _('The processes are gone, but the memory was not released.');
    case 'unverified':
        return format(ngettext('%d process ended; the memory could not be verified.',
            '%d processes ended; the memory could not be verified.', ended), ended);
    default:
        return format(_('The sweep ended: %s %s'), escapeText(report.outcome ?? ''),
            escapeText(report.error ?? ''));
    }
}

export const SweepDialog = GObject.registerClass(
class GpuGuardSweepDialog extends ModalDialog.ModalDialog {
    _init(client, index) {
        super._init({styleClass: 'gpuguard-sweep-dialog'});
        this._client = client;
        this._index = index;
        this._content = new Dialog.MessageDialogContent({
            title: format(_('Sweep GPU %d'), index),
            description: _('Asking gpuguardd what a sweep would do…'),
        });
        this.contentLayout.add_child(this._content);
        this._plan = new St.Label({style_class: 'gpuguard-plan', text: ''});
        this._plan.clutter_text.line_wrap = true;
        this.contentLayout.add_child(this._plan);
        this._cancel = {label: _('Cancel'), action: () => this.close(), key: 0xff1b /* Escape */};
        this.setButtons([this._cancel]);
        client.sweep(index, true, (report, error) => this._planned(report, error));
    }

    _planned(report, error) {
        if (error) {
            this._content.description = format(_('The plan could not be made: %s'), escapeText(errorText(error)));
            return;
        }
        [this._content.description, this._plan.text] = plan(report);
        if ((report.targets ?? []).length) {
            this.setButtons([this._cancel, {
                label: _('Sweep'),
                action: () => this._sweep(),
                default: true,
            }]);
        }
    }

    _sweep() {
        this.setButtons([{label: _('Close'), action: () => this.close()}]);
        this._plan.text = '';
        this._content.description = _('Sweeping…');
        this._client.sweep(this._index, false, (report, error) => {
            if (error && isRefusal(error))
                this._content.description = _('Not authorized: the sweep was refused.');
            else if (error)
                this._content.description = format(_('The sweep failed: %s'), escapeText(errorText(error)));
            else
                this._content.description = resultText(report);
        });
    }
});
