// Cockpit's light and dark themes: the shell keeps the choice in localStorage "shell:style"
// ("auto", "light", "dark"; "auto" follows the browser's colour scheme) and announces changes
// with a "storage" event (or "cockpit-style" in newer shells). What Cockpit's own
// pkg/lib/cockpit-dark-theme.js does, for PatternFly 6's class.
const DARK_CLASS = "pf-v6-theme-dark";
const query = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;

function storedStyle() {
    try {
        return window.localStorage.getItem("shell:style") || "auto";
    } catch (e) {
        return "auto"; // storage blocked: follow the browser
    }
}

export function applyTheme(style) {
    const chosen = style || storedStyle();
    const dark = chosen === "dark" || (chosen === "auto" && !!query && query.matches);
    document.documentElement.classList.toggle(DARK_CLASS, dark);
}

export function followTheme() {
    window.addEventListener("storage", event => {
        if (event.key === "shell:style")
            applyTheme();
    });
    window.addEventListener("cockpit-style", event => applyTheme(event.detail && event.detail.style));
    if (query)
        query.addEventListener("change", () => applyTheme());
    applyTheme();
}
