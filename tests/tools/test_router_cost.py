"""tools/router_cost: the router's own CPU per token, through the real Subscription and Output.
Every token reaches the user, grouped as the stream interval says (1 token, or the first alone
and then 8 a message with the final joined to the last)."""

from __future__ import annotations

import json

from tools import router_cost


def test_streams_reach_the_user_grouped_per_interval(tmp_path):
    out = tmp_path / "cost.json"
    assert router_cost.main(["--requests", "4", "--tokens", "17", "--intervals", "1,8", "--rounds", "2",
                             "--at-source", "--json", str(out)]) == 0
    rows = {(r["interval"], r["at_source"]): r for r in json.loads(out.read_text())["intervals"]}
    assert set(rows) == {(1, False), (8, False), (8, True)}
    assert rows[1, False]["messages_per_request"] == 17
    # [1], [2..9], [10..17 with the finish]: the same whether RLD or the router groups them
    assert rows[8, False]["messages_per_request"] == rows[8, True]["messages_per_request"] == 3
    assert all(0 < x < 1e5 for r in rows.values() for x in r["rounds"]) and len(rows[8, True]["rounds"]) == 2
