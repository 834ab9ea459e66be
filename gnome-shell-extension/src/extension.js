// GPU Guard's GNOME Shell extension: gpuguardd's D-Bus state in the top bar, and
// notifications of leaks, sweeps that left something behind, and the user's own processes a
// sweep ended. The same source serves GNOME 43/44 and 45+ (build.py makes both layouts).

import Gio from 'gi://Gio';
import GLib from 'gi://GLib';

import {GpuGuardClient} from './client.js';
import {_, ExtensionBase, Main} from './compat.js';
import {escapeText} from './escape.js';
import {Indicator} from './indicator.js';
import {format, formatBytes} from './state.js';
import {ResetDialog} from './resetDialog.js';
import {SweepDialog} from './sweepDialog.js';

function announce(kind, data) {
    const notify = (title, body) => Main.notify(title, body);
    if (kind === 'leak') {
        // data.title: the GPU's vendor and name, escaped (state.js gpuTitle); '' if unknown.
        notify(format(_('GPU %d: memory leaked'), data.gpu), data.title
            ? format(_('%s in use with no process holding the GPU (%s).'), formatBytes(data.bytes), data.title)
            : format(_('%s in use with no process holding the GPU.'), formatBytes(data.bytes)));
    } else if (kind === 'left-behind') {
        const report = data.report;
        const survived = (report.survived ?? []).map(s => escapeText(s.comm ?? '')).join(', ');
        notify(_('A GPU sweep left something behind'), report.outcome === 'survivors'
            ? format(_('Still running: %s'), survived)
            : _('The processes are gone, but the GPU memory was not released.'));
    } else if (kind === 'ended-mine') {
        const names = data.ended.map(t => `${escapeText(t.comm ?? '')} (${Number(t.pid)})`).join(', ');
        notify(_('Your GPU processes were ended'), format(_('%s, by a sweep asked by %s'),
            names, escapeText(data.report.requested_by || _('unknown'))));
    }
}

export default class GpuGuardExtension extends ExtensionBase {
    enable() {
        const file = Gio.File.new_for_path(GLib.build_filenamev([this.path, 'org.gpuguard.GpuGuard1.xml']));
        const [, bytes] = file.load_contents(null);
        const xml = new TextDecoder().decode(bytes);
        this._client = new GpuGuardClient(xml, () => this._indicator?.sync(), announce);
        const open = Dialog => index => {
            this._dialog?.close();
            this._dialog = new Dialog(this._client, index);
            this._dialog.connect('closed', () => {
                this._dialog = null;
            });
            this._dialog.open();
        };
        this._indicator = new Indicator(this._client, open(SweepDialog), open(ResetDialog));
        Main.panel.addToStatusArea(this.metadata.uuid, this._indicator);
        this._client.start();
    }

    disable() {
        this._dialog?.close();
        this._dialog = null;
        this._client?.destroy();
        this._client = null;
        this._indicator?.destroy();
        this._indicator = null;
    }
}
