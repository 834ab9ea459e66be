// Builds the page into dist/: what `make cockpit` runs, and all that packages ship (no node
// on the installed machine). esbuild bundles React, PatternFly's components and only their CSS.
import * as esbuild from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";

const production = process.env.NODE_ENV !== "development";
rmSync("dist", { recursive: true, force: true });
mkdirSync("dist");

await esbuild.build({
    entryPoints: ["src/index.jsx"],
    bundle: true,
    outfile: "dist/gpuguard.js",
    format: "iife",
    target: ["es2020"],
    jsx: "automatic",
    minify: production,
    // The licenses of the bundled libraries go beside the bundle, not into it.
    legalComments: "linked",
    define: { "process.env.NODE_ENV": JSON.stringify(production ? "production" : "development") },
    loader: { ".woff2": "file", ".woff": "file", ".svg": "file", ".png": "file", ".jpg": "file" },
    assetNames: "assets/[name]-[hash]",
    logLevel: "warning",
});

for (const file of ["index.html", "manifest.json"])
    copyFileSync(`src/${file}`, `dist/${file}`);
