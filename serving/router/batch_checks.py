"""What the user's stream checks of a tier's TokenBatch before it passes it on (stream.Output).

`ends_stream`: the item ends what the tier sends for the request (an Abort, a finish, a handoff).
`check_logprobs`: a request that asked for logprobs gets one per token (P's first token filled
in from its Prefilled when MD's take-over batch starts with it), else INTERNAL naming the tier.
`cut_to`: an MD batch after the switch may start behind the user (MD emits from its final
handoff position); the part the user already has must equal what the user got, and only the
rest goes on.
"""

from __future__ import annotations

import grpc

from serving.pb import cluster_pb2, common_pb2
from serving.router.request import Abort


def ends_stream(item) -> bool:
    """A tier's last item for the request: its Abort, its finish, or its handoff."""
    return isinstance(item, Abort) or bool(item.finish_reason) or item.handed_off


def check_logprobs(it: cluster_pb2.TokenBatch, role: int, first_logprob) -> None:
    """`it` carries one logprob per token (its first filled in from `first_logprob`, P's, when
    it is the stream's first token alone); else Abort INTERNAL naming RLD or MD."""
    if len(it.logprobs) == len(it.token_ids):
        return
    if (not it.logprobs and it.start_position == 0 and it.token_ids and first_logprob is not None
            and len(it.token_ids) == 1):
        it.logprobs.append(first_logprob)
        return
    name = "MD" if role == common_pb2.ROLE_MAIN else "RLD"
    raise Abort(grpc.StatusCode.INTERNAL, f"{name} sent {len(it.token_ids)} tokens with {len(it.logprobs)} "
                                          f"logprobs at position {it.start_position}")


def cut_to(it: cluster_pb2.TokenBatch, position: int, user: list[int]) -> cluster_pb2.TokenBatch | None:
    """An MD batch cut to start at `position`, the user holding `user` (its overlap with them
    checked: Abort INTERNAL if they differ); None if it holds nothing new."""
    if not it.token_ids or it.start_position >= position:
        return it
    have = min(position - it.start_position, len(it.token_ids))  # tokens of it the user has
    if list(it.token_ids[:have]) != user[it.start_position:it.start_position + have]:
        raise Abort(grpc.StatusCode.INTERNAL, f"MD's tokens disagree with the stream at {it.start_position}")
    if have == len(it.token_ids):  # nothing new; its finish counts only where the user's tokens end
        at_end = it.finish_reason and it.start_position + have == position
        return cluster_pb2.TokenBatch(start_position=position, finish_reason=it.finish_reason) if at_end else None
    return cluster_pb2.TokenBatch(start_position=position, token_ids=it.token_ids[have:],
                                  finish_reason=it.finish_reason, logprobs=it.logprobs[have:])
