"""The algorithm state of runs written before payloads had names, read as it is named now.

FedAvg, FedProx and FedSense runs kept one uplink payload and one downlink copy under plain keys;
:meth:`~geofm.fl.algorithms.base.Algorithm.receive` and
:meth:`~geofm.fl.algorithms.base.Algorithm.load_state_dict` read their states through these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CLIENT_KEYS = {
    "feedback.error": "feedback.update.error",
    "feedback.rounds": "feedback.update.rounds",
    "reference": "downlink.model",
}
"""Client state keys of runs written before payloads had names, and their names now."""


def client_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A client's state with the keys of before named payloads renamed (other keys as they are)."""
    return {CLIENT_KEYS.get(key, key): value for key, value in state.items()}


def server_state(saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """The server's algorithm state, that of a run of before named payloads given the named layout
    (its norms the ``update`` payload's, its downlink copy the ``model``'s); a current one as it is."""
    if "references" in saved:
        return saved
    return {
        **saved,
        "recent_norms": {"update": saved.get("recent_norms", [])},
        "references": {"model": saved["reference"]} if saved.get("reference") is not None else {},
        "synced": saved.get("synced", {}),
    }


__all__ = ["CLIENT_KEYS", "client_state", "server_state"]
