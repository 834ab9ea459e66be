// GNOME Shell 43 and 44 (legacy imports): what compat45.js gives 45 and later, under the
// same names. build.py installs this file as compat.js in the 43 layout, unchanged.
const ExtensionUtils = imports.misc.extensionUtils;

var Dialog = imports.ui.dialog;
var Main = imports.ui.main;
var ModalDialog = imports.ui.modalDialog;
var PanelMenu = imports.ui.panelMenu;
var PopupMenu = imports.ui.popupMenu;
var _ = ExtensionUtils.gettext;
var ngettext = ExtensionUtils.ngettext;

var ExtensionBase = class ExtensionBase {
    constructor(metadata) {
        this.metadata = metadata;
        this.path = metadata.path;
        ExtensionUtils.initTranslations(metadata['gettext-domain']);
    }
};
