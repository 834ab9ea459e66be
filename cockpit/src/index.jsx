// Entry point: PatternFly's base styles, the page's, the theme, and the app.
import "@patternfly/react-core/dist/styles/base.css";
import "./gpuguard.css";

import React from "react";
import { createRoot } from "react-dom/client";

import { App } from "./app.jsx";
import { GuardModel } from "./model.js";
import { followTheme } from "./theme.js";

followTheme();
document.addEventListener("DOMContentLoaded", () => {
    window.cockpit.translate();
    const model = new GuardModel();
    createRoot(document.getElementById("app")).render(<App model={model} />);
});
