"""A holder whose uid cannot be read is still sent with `uid` as a `u`: (uid_t)-1, which Linux
never gives a process, never the engine's -1 (that would go out as an `x` or fail the reply)."""

from __future__ import annotations

from gpuguardd.bus import marshal, names
from gpuguardd.records.models import Holder


def test_unknown_uid_is_sent_as_uid_t_minus_one() -> None:
    typed = marshal.holder(Holder(pid=4242, comm="x", uid=-1).to_dict())
    assert typed["uid"].signature == "u"
    assert typed["uid"].value == names.UID_UNKNOWN == 4294967295
    assert typed["pid"].signature == "u" and typed["user"].value == ""


def test_known_uid_is_sent_as_it_is() -> None:
    typed = marshal.holder(Holder(pid=4242, comm="x", uid=65534, user="nobody").to_dict())
    assert typed["uid"].signature == "u" and typed["uid"].value == 65534


def test_the_cli_shows_an_unknown_uid_as_a_question_mark() -> None:
    import io

    from gpuguardd.bus.marshal import unwrap
    from gpuguardd.cli import output
    out = io.StringIO()
    output.print_holders([Holder.from_dict(unwrap(marshal.holder(Holder(pid=4242, comm="x", uid=-1).to_dict())))],
                         out)
    row = out.getvalue().splitlines()[1].split()
    assert row[:2] == ["4242", "?"] and "4294967295" not in out.getvalue()
