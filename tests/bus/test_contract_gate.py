"""Authorization denied by default, on a real bus: a method whose XML declares no rule is
refused to a real caller through dbus-fast's dispatch, and introspection is the XML's.

The interface here is a small document of its own, served under gpuguardd's names (which the
installed bus policy lets callers reach); the daemon's XML declares a rule for every method,
and tests/unit/bus/test_contract.py holds it to that.
"""

from __future__ import annotations

import asyncio

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from gpuguardd.bus.connection import GuardBus
from gpuguardd.bus.contract import Contract
from gpuguardd.bus.interfaces import ContractInterface
from gpuguardd.bus.names import BUS_NAME, ERROR_PREFIX, MANAGER_INTERFACE
from tests.dbus_harness import BusDaemon

pytest_plugins = ["tests.dbus_harness"]

NAME = MANAGER_INTERFACE
DEFINITION = Contract(f"""<node><interface name="{NAME}">
  <method name="Open">
    <annotation name="org.gpuguard.GpuGuard1.Authorization" value="public"/>
    <arg name="n" type="u" direction="in"/><arg name="m" type="u" direction="out"/>
  </method>
  <method name="Forgotten"><arg name="n" type="u" direction="in"/></method>
</interface></node>""")


class Probe(ContractInterface, interface=NAME, definition=DEFINITION):
    calls: list[str] = []  # noqa: RUF012 (one test, one list)

    async def Open(self, n: int) -> int:
        self.calls.append("Open")
        return n + 1

    async def Forgotten(self, n: int) -> None:
        self.calls.append("Forgotten")


async def busctl(address: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "busctl", f"--address={address}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_a_method_without_a_rule_is_refused_over_the_bus(system_bus: BusDaemon) -> None:
    async def scenario() -> None:
        bus = await GuardBus(bus_address=system_bus.address).connect()
        try:
            bus.export("/test", Probe({}))
            await bus.request_name(BUS_NAME)
            client = await MessageBus(bus_address=system_bus.address).connect()

            async def call(member: str, n: int) -> Message:
                reply = await client.call(Message(destination=BUS_NAME, path="/test",
                                                  interface=NAME, member=member, signature="u",
                                                  body=[n]))
                assert reply is not None
                return reply

            try:
                opened = await call("Open", 41)
                assert opened.message_type == MessageType.METHOD_RETURN, (opened.error_name, opened.body)
                assert opened.body == [42]
                refused = await call("Forgotten", 1)
            finally:
                client.disconnect()
            assert refused.message_type == MessageType.ERROR
            assert refused.error_name == ERROR_PREFIX + "NotAuthorized", refused.body
            assert "Forgotten declares no authorization" in refused.body[0]
            code, out, err = await busctl(system_bus.address, "introspect", "--xml-interface",
                                          BUS_NAME, "/test")
            assert code == 0, err
            assert 'name="org.gpuguard.GpuGuard1.Authorization" value="public"' in out
            assert out.count("org.gpuguard.GpuGuard1.Authorization") == 1, out
        finally:
            bus.disconnect()

    Probe.calls.clear()
    asyncio.run(scenario())
    assert Probe.calls == ["Open"], "the refused method never ran"
