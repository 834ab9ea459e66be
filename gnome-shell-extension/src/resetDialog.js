// "Reset GPU N…", offered for a leaked GPU: what a reset does, then the reset through the bus
// (ResetGpu, its own polkit action: the shell's agent asks for an administrator every time).
// gpuguardd refuses while anything holds the GPU, and says why; that is shown as it says it.

import GObject from 'gi://GObject';

import {isRefusal, errorText} from './client.js';
import {_, Dialog, ModalDialog} from './compat.js';
import {escapeText} from './escape.js';
import {format} from './state.js';

function resultText(report) {
    switch (report.outcome) {
    case 'reset':
        return _('Done: the GPU was reset and its memory is back.');
    case 'reset-refused':
        return format(_('Not reset: %s'), escapeText(report.error ?? ''));
    default:
        return format(_('The reset failed: %s'), escapeText(report.error || report.outcome || ''));
    }
}

export const ResetDialog = GObject.registerClass(
class GpuGuardResetDialog extends ModalDialog.ModalDialog {
    _init(client, index) {
        super._init({styleClass: 'gpuguard-sweep-dialog'});
        this._client = client;
        this._index = index;
        this._content = new Dialog.MessageDialogContent({
            title: format(_('Reset GPU %d'), index),
            description: _('Memory stays in use with no process holding it. A reset clears it ' +
                'without a reboot; gpuguardd does it only while nothing holds the GPU, and then ' +
                'checks that the memory came back.'),
        });
        this.contentLayout.add_child(this._content);
        this.setButtons([
            {label: _('Cancel'), action: () => this.close(), key: 0xff1b /* Escape */},
            {label: _('Reset'), action: () => this._reset(), default: true},
        ]);
    }

    _reset() {
        this.setButtons([{label: _('Close'), action: () => this.close()}]);
        this._content.description = _('Resetting…');
        this._client.reset(this._index, (report, error) => {
            if (error && isRefusal(error))
                this._content.description = _('Not authorized: the reset was refused.');
            else if (error)
                this._content.description = format(_('The reset failed: %s'), escapeText(errorText(error)));
            else
                this._content.description = resultText(report);
        });
    }
});
