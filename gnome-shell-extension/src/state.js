// What the indicator shows, from the daemon's properties alone: pure functions, no GNOME
// Shell imports, so the tests run them under gjs and node (tests/desktop).
//
// The icon is the worst GPU state: a GPU that fell off the bus or cannot be read says more
// than a leak, a leak more than a sweep running, a sweep more than a GPU in use, and a
// sleeping GPU (runtime-suspended: gpuguardd does not wake it to ask) least of all.

import {escapeText} from './escape.js';

export const ABSENT = 'absent';  // gpuguardd is not on the bus
export const SWEEPING = 'sweeping';

const RANK = ['suspended', 'idle', 'in-use', SWEEPING, 'leaked', 'unknown', 'lost'];

export const ICONS = {
    [ABSENT]: 'action-unavailable-symbolic',
    'suspended': 'weather-clear-night-symbolic',
    'idle': 'emblem-ok-symbolic',
    'in-use': 'system-run-symbolic',
    [SWEEPING]: 'emblem-synchronizing-symbolic',
    'leaked': 'dialog-warning-symbolic',
    'unknown': 'dialog-error-symbolic',
    'lost': 'dialog-error-symbolic',
};

// A state the daemon may add later ranks as "unknown": never shown as fine.
function rank(state) {
    const found = RANK.indexOf(state);
    return found < 0 ? RANK.indexOf('unknown') : found;
}

export function worstState(gpuStates, busy, onBus) {
    if (!onBus)
        return ABSENT;
    let worst = gpuStates.length ? gpuStates[0] : 'idle';
    for (const state of gpuStates) {
        if (rank(state) > rank(worst))
            worst = state;
    }
    if (busy && rank(SWEEPING) > rank(worst))
        worst = SWEEPING;
    return worst;
}

export function iconFor(state) {
    return ICONS[state] ?? ICONS['unknown'];
}

// Bytes as people read GPU memory: binary units, one decimal from GiB up.
export function formatBytes(bytes) {
    const n = Number(bytes) || 0;
    if (n >= 2 ** 30)
        return `${(n / 2 ** 30).toFixed(1)} GiB`;
    if (n >= 2 ** 20)
        return `${Math.round(n / 2 ** 20)} MiB`;
    return `${Math.round(n / 1024)} KiB`;
}

// The caller's own processes first, then by GPU memory, largest first.
export function sortHolders(holders, uid) {
    return [...holders].sort((a, b) => {
        const mineA = a.uid === uid ? 0 : 1, mineB = b.uid === uid ? 0 : 1;
        if (mineA !== mineB)
            return mineA - mineB;
        return Number(b.gpu_memory ?? 0) - Number(a.gpu_memory ?? 0) || (a.pid ?? 0) - (b.pid ?? 0);
    });
}

// One holder's line: command, PID, unit or container, memory. Every text from the bus is
// chosen by whoever started the process, so each is escaped by the CLI's rule.
export function holderLine(holder) {
    const parts = [`${escapeText(holder.comm ?? '')} (${Number(holder.pid) || 0})`];
    const where = holder.container || holder.unit;
    if (where)
        parts.push(escapeText(where));
    if (Number(holder.gpu_memory))
        parts.push(formatBytes(holder.gpu_memory));
    return parts.join(' · ');
}

// Which GPU, for a person: its vendor and product name ("amd AMD Instinct MI300X"), each
// escaped (both come from the driver: NVML, or the amdgpu driver's sysfs files). A gpuguardd
// from before vendors knew NVIDIA GPUs only: the client says "nvidia" for it (client.js).
export function gpuTitle(gpu) {
    return [gpu.vendor, gpu.name].filter(part => part).map(escapeText).join(' ');
}

// Whether a finished sweep left something behind: what a notification is for.
export function sweepLeftBehind(report) {
    return report.outcome === 'survivors' || report.outcome === 'memory-not-released';
}

// The processes of user `uid` that a sweep ended: by the report's uid of each, or, from a
// gpuguardd whose reports lack it, the holders listed before (`known`: pid -> holder, the
// same command).
export function endedOf(report, known, uid) {
    return (report.terminated ?? []).filter(t => t.uid !== undefined ? t.uid === uid
        : known.get(Number(t.pid))?.uid === uid && known.get(Number(t.pid))?.comm === t.comm);
}

// printf-style %s and %d in order, as translators write them (String.prototype.format is
// the shell's own addition and not promised to every version).
export function format(template, ...args) {
    let next = 0;
    return template.replace(/%[sd%]/g, spec => {
        if (spec === '%%')
            return '%';
        const value = args[next++];
        return spec === '%d' ? String(Math.trunc(Number(value))) : String(value);
    });
}
