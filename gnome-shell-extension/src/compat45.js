// GNOME Shell 45 and later (ES modules): the shell's modules the extension uses, under the
// names the rest of the source imports from './compat.js' (build.py installs this file as
// compat.js in the 45 layout; compat43.js is its GNOME 43/44 twin).
import * as Dialog from 'resource:///org/gnome/shell/ui/dialog.js';
import * as Main from 'resource:///org/gnome/shell/ui/main.js';
import * as ModalDialog from 'resource:///org/gnome/shell/ui/modalDialog.js';
import * as PanelMenu from 'resource:///org/gnome/shell/ui/panelMenu.js';
import * as PopupMenu from 'resource:///org/gnome/shell/ui/popupMenu.js';
import {Extension, gettext, ngettext} from 'resource:///org/gnome/shell/extensions/extension.js';

export {Dialog, Main, ModalDialog, PanelMenu, PopupMenu, ngettext};
export const _ = gettext;

// The extension's entry point extends this: 45's Extension (translations set up from
// metadata.json's gettext-domain, this.path) or, on 43, a class doing the same by hand.
export const ExtensionBase = Extension;
