// The top-bar indicator: an icon for the worst GPU state, greyed while gpuguardd is away,
// and a menu of the GPUs, their holders (the user's own first) and the last sweep.

import GLib from 'gi://GLib';
import GObject from 'gi://GObject';
import St from 'gi://St';

import {_, ngettext, PanelMenu, PopupMenu} from './compat.js';
import {escapeText} from './escape.js';
import {format, formatBytes, gpuTitle, holderLine, iconFor, sortHolders, worstState, ABSENT} from './state.js';

// The states as the menu names them (the wire's words are the contract's, not prose).
function stateName(state) {
    return {
        'idle': _('idle'),
        'in-use': _('in use'),
        'leaked': _('leaked'),
        'lost': _('lost'),
        'unknown': _('unknown'),
        'suspended': _('asleep'),
        'sweeping': _('sweep running'),
    }[state] ?? escapeText(state);
}

function outcomeName(outcome) {
    return {
        'freed': _('memory freed'),
        'nothing-to-do': _('nothing to do'),
        'survivors': _('processes survived'),
        'memory-not-released': _('memory not released'),
        'unverified': _('not verified'),
        'dry-run': _('dry run'),
        'error': _('failed'),
        'interrupted': _('interrupted'),
    }[outcome] ?? escapeText(outcome);
}

function when(usec) {
    const seconds = Math.floor(Number(usec) / 1e6);
    const time = GLib.DateTime.new_from_unix_local(seconds);
    return time ? time.format('%Y-%m-%d %H:%M:%S') : '';
}

// Style classes by state (stylesheet.css); a state the daemon adds later gets none.
const STATE_STYLES = {
    'leaked': 'gpuguard-warning',
    'lost': 'gpuguard-error',
    'unknown': 'gpuguard-error',
};

// A line of text that cannot be clicked: what most of the menu is.
function infoItem(text, styleClass = '') {
    const item = new PopupMenu.PopupMenuItem(text, {reactive: false, can_focus: false});
    if (styleClass)
        item.label.add_style_class_name(styleClass);
    return item;
}

export const Indicator = GObject.registerClass(
class GpuGuardIndicator extends PanelMenu.Button {
    _init(client, onSweep, onReset) {
        super._init(0.0, _('GPU Guard'));
        this._client = client;
        this._onSweep = onSweep;
        this._onReset = onReset;
        this._icon = new St.Icon({
            icon_name: iconFor(ABSENT),
            style_class: 'system-status-icon',
        });
        this.add_child(this._icon);
        this.menu.connect('open-state-changed', (_menu, open) => {
            if (open)
                this._client.refreshHolders();
        });
        this.sync();
    }

    // Everything from the client's current view; called on every change it reports.
    sync() {
        const gpus = this._client.gpus;
        const onBus = this._client.onBus;
        const state = worstState(gpus.map(g => g.state), this._client.busy, onBus);
        this._icon.icon_name = iconFor(state);
        // Greyed, not hidden: the user sees that gpuguardd is away, and the menu says so.
        this.opacity = onBus ? 255 : 128;
        this.accessible_name = format(_('GPU Guard: %s'), onBus ? stateName(state) : _('not running'));
        this._rebuildMenu(gpus, onBus);
    }

    _rebuildMenu(gpus, onBus) {
        this.menu.removeAll();
        if (!onBus) {
            this.menu.addMenuItem(infoItem(_('gpuguardd is not running')));
            return;
        }
        for (const gpu of gpus) {
            const holders = format(ngettext('%d holder', '%d holders', gpu.holder_count), gpu.holder_count);
            const line = format(_('GPU %d: %s, %s of %s, %s, %s'),
                gpu.index, gpuTitle(gpu), formatBytes(gpu.memory_used),
                formatBytes(gpu.memory_total), holders, stateName(gpu.state));
            this.menu.addMenuItem(infoItem(line, gpu.state in STATE_STYLES ? STATE_STYLES[gpu.state] : ''));
        }
        if (!gpus.length)
            this.menu.addMenuItem(infoItem(_('No GPUs')));

        const holders = sortHolders(this._client.holders, this._client.uid);
        if (holders.length) {
            this.menu.addMenuItem(new PopupMenu.PopupSeparatorMenuItem(_('Holders')));
            for (const holder of holders.slice(0, 20)) {
                const mine = holder.uid === this._client.uid;
                this.menu.addMenuItem(infoItem(holderLine(holder), mine ? 'gpuguard-mine' : ''));
            }
            if (holders.length > 20)
                this.menu.addMenuItem(infoItem(format(_('… and %d more'), holders.length - 20)));
        }

        const last = this._client.lastSweep;
        if (last && last.id) {
            this.menu.addMenuItem(new PopupMenu.PopupSeparatorMenuItem(_('Last sweep')));
            this.menu.addMenuItem(infoItem(format(_('%s, %s, asked by %s'),
                outcomeName(last.outcome), when(last.started_usec),
                escapeText(last.requested_by || _('unknown')))));
        }

        if (gpus.length) {
            this.menu.addMenuItem(new PopupMenu.PopupSeparatorMenuItem());
            for (const gpu of gpus) {
                const item = new PopupMenu.PopupMenuItem(format(_('Sweep GPU %d…'), gpu.index));
                item.connect('activate', () => this._onSweep(gpu.index));
                this.menu.addMenuItem(item);
            }
            // A leaked GPU (memory in use, nothing holding it): the daemon may reset it.
            for (const gpu of gpus.filter(g => g.state === 'leaked')) {
                const item = new PopupMenu.PopupMenuItem(format(_('Reset GPU %d…'), gpu.index));
                item.connect('activate', () => this._onReset(gpu.index));
                this.menu.addMenuItem(item);
            }
        }
    }
});
