// One rule for text shown to a person, the page's copy of gpuguardd/escaping.py (the CLI's
// and the journal's): every character that is not printable in Python's sense (str.isprintable:
// Unicode "Other" (Cc controls, Cf format such as bidi overrides and zero-width characters, Cs,
// Co, Cn) and "Separator" (Zs, Zl, Zp) except the ASCII space) is shown as a Python-style
// backslash escape: \n \r \t, else \xNN, \uNNNN or \UNNNNNNNN in lower-case hex. A process
// name with U+202E then reads "\u202egnp.exe", never reversed, and ESC or BEL are text, not
// boxes. Both implementations are held to the same table, tests/escaping_vectors.json.
// Plain module, no imports: node runs it against that table (tests/cockpit).

const NOT_PRINTABLE = /[\p{C}\p{Z}]/gu;
const NAMED = { "\n": "\\n", "\r": "\\r", "\t": "\\t" };

function escapeChar(ch) {
    if (ch === " ")
        return ch;
    if (NAMED[ch])
        return NAMED[ch];
    const code = ch.codePointAt(0);
    const hex = code.toString(16);
    if (code < 0x100)
        return "\\x" + hex.padStart(2, "0");
    if (code < 0x10000)
        return "\\u" + hex.padStart(4, "0");
    return "\\U" + hex.padStart(8, "0");
}

export function escapeText(text) {
    return String(text).replace(NOT_PRINTABLE, escapeChar);
}

// `data` (objects, arrays, strings, numbers) with every string in it escaped, keys included:
// what the page shows is made from this, so no field can be forgotten (escaping.escaped).
export function escaped(data) {
    if (typeof data === "string")
        return escapeText(data);
    if (Array.isArray(data))
        return data.map(escaped);
    if (data !== null && typeof data === "object") {
        const out = {};
        for (const key of Object.keys(data))
            out[escapeText(key)] = escaped(data[key]);
        return out;
    }
    return data;
}
