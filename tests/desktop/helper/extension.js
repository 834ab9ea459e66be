// A test-only GNOME Shell 43 extension (tests/desktop): it lets the test read what the GPU
// Guard indicator shows, straight from its actors, and open its menu, over the shell's session
// bus, so nothing needs the shell's unsafe mode (org.gnome.Shell.Eval), whose lock icon
// would show in the screenshots.
const {Gio} = imports.gi;
const Main = imports.ui.main;

const UUID = 'gpuguard@gpuguard.org';
const XML = `<node><interface name="org.gpuguard.TestHelper">
  <method name="Describe"><arg type="s" direction="out"/></method>
  <method name="OpenMenu"/>
  <method name="CloseMenu"/>
  <method name="ActivateMenuItem"><arg type="s" direction="in"/></method>
  <method name="DescribeDialog"><arg type="s" direction="out"/></method>
  <method name="PressDialogButton"><arg type="s" direction="in"/></method>
</interface></node>`;

// The extension's open dialog (a ModalDialog in the shell's modal dialog group), if any.
function openDialog() {
    return Main.layoutManager.modalDialogGroup.get_children().find(d => d._content) ?? null;
}

function ascii(text) {
    return text.replace(/[\u007f-\uffff]/g, c => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

class Helper {
    enable() {
        this._object = Gio.DBusExportedObject.wrapJSObject(XML, this);
        this._object.export(Gio.DBus.session, '/org/gpuguard/TestHelper');
        this._name = Gio.bus_own_name_on_connection(Gio.DBus.session, 'org.gpuguard.TestHelper',
            Gio.BusNameOwnerFlags.NONE, null, null);
    }

    disable() {
        Gio.bus_unown_name(this._name);
        this._object.unexport();
    }

    // ASCII JSON: gdbus prints the reply as a GVariant text literal, which the test decodes.
    Describe() {
        return ascii(this._describe());
    }

    ActivateMenuItem(label) {
        const item = Main.panel.statusArea[UUID].menu._getMenuItems().find(i => i.label?.text === label);
        if (!item)
            throw new Error(`no menu item ${label}`);
        item.activate(null);
    }

    DescribeDialog() {
        const dialog = openDialog();
        if (!dialog)
            return 'null';
        return ascii(JSON.stringify({
            title: dialog._content.title,
            description: dialog._content.description,
            plan: dialog._plan ? dialog._plan.text : '',  // the reset dialog has no plan
            buttons: dialog.buttonLayout.get_children().map(b => b.label),
        }));
    }

    PressDialogButton(label) {
        const button = openDialog()?.buttonLayout.get_children().find(b => b.label === label);
        if (!button)
            throw new Error(`no dialog button ${label}`);
        button.emit('clicked', 1);
    }

    _describe() {
        const indicator = Main.panel.statusArea[UUID];
        const notifications = Main.messageTray.getSources().flatMap(
            source => source.notifications.map(n => `${n.title}: ${n.bannerBodyText ?? ''}`));
        if (!indicator)
            return JSON.stringify({indicator: null, notifications});
        return JSON.stringify({
            indicator: {
                icon: indicator._icon.icon_name,
                opacity: indicator.opacity,
                visible: indicator.visible,
                accessible_name: indicator.accessible_name,
                menu_open: indicator.menu.isOpen,
                items: indicator.menu._getMenuItems().map(item => item.label?.text ?? ''),
            },
            notifications,
        });
    }

    OpenMenu() {
        Main.panel.statusArea[UUID].menu.open(false);
    }

    CloseMenu() {
        Main.panel.statusArea[UUID].menu.close(false);
    }
}

function init() {
    return new Helper();
}
