"""The signed collectives: every first frame names what its rank is doing, so ranks
that disagree (other settings, another step) or failed to encode raise together
instead of waiting for each other or reading the wrong bytes."""

from __future__ import annotations

from deepreduce.collectives import frames
from deepreduce.collectives.transport import Traffic


def fail_collectively(first_collective, transport, signature, error, traffic=None,
                      stage=None):
    """Take part in a reduction's first collective with an ERROR frame, then raise ``error``.

    The other ranks read the frame and raise too, instead of waiting forever. ``stage``
    must be the one the other ranks' collective names (by default "gather" or
    "scatter"): a transport may frame each stage its own way (TorchTransport's slot
    follows the stage's recent frames).
    """
    frame = frames.signed(signature, frames.error_frame(f"{type(error).__name__}: {error}"))
    traffic = Traffic() if traffic is None else traffic
    if first_collective == "allgather":
        transport.allgather(frame, traffic, stage or "gather")
    else:
        transport.alltoall([b"" if r == transport.rank else frame
                            for r in range(transport.size)], traffic, stage or "scatter")
    raise error


def signed_allgather(transport, signature: str, frame, traffic, stage: str) -> list:
    """Every rank's ``frame``, sent behind ``signature``: the one allgather of deepreduce.

    Returns the frames in rank order (this rank's own as given), after
    :func:`check_peers`: a rank that sent an ERROR frame or another signature
    makes every rank raise.
    """
    rank = transport.rank
    gathered = transport.allgather(frames.signed(signature, frame), traffic, stage)
    bodies = check_peers({r: f for r, f in enumerate(gathered) if r != rank}, signature, rank)
    return [memoryview(frame) if r == rank else bodies[r] for r in range(transport.size)]


def agree_settings(transport, settings: dict, stage: str = "settings") -> None:
    """Raise on every rank, naming what differs, unless every rank of ``transport`` has the
    same ``settings`` (``{name: value}``, compared as their text): the check an
    integration makes before its first step, so that ranks built alike cannot hang in a
    collective that the others would not join. A collective: every rank calls it."""
    signature = ";".join(f"{k}={v}" for k, v in settings.items())
    signed_allgather(transport, signature, b"", Traffic(), stage)


def signed_alltoall(transport, signature: str, per_rank: list, traffic, stage: str) -> dict:
    """Send ``per_rank[r]`` to rank ``r`` behind ``signature``; return the checked replies.

    This rank's own entry stays home. Returns ``{rank: frame body}`` of the
    other ranks, after :func:`check_peers`.
    """
    rank, size = transport.rank, transport.size
    signed = [b"" if r == rank else frames.signed(signature, frame)
              for r, frame in enumerate(per_rank)]
    received = transport.alltoall(signed, traffic, stage)
    return check_peers({r: received[r] for r in range(size) if r != rank}, signature, rank)


def check_peers(received: dict, signature: str, rank: int) -> dict:
    """Read the signed first frames of the other ranks; raise on errors or disagreement.

    ``received`` maps each other rank to its frame. Returns ``{rank: frame body}``.
    Every rank sees the same frames, so every rank raises the same way.
    """
    bodies, errors, mismatches = {}, [], []
    for peer, frame in received.items():
        theirs, body = frames.read_signed(frame)
        if len(body) and body[0] == frames.ERROR:
            errors.append(f"rank {peer}: {bytes(body[1:]).decode('utf-8', 'replace')}")
        elif theirs != signature:
            mismatches.append((peer, theirs))
        bodies[peer] = body
    if errors:
        raise frames.PeerError("another rank could not take part in the reduction: "
                               + "; ".join(errors))
    if mismatches:
        everyone = {peer: theirs for peer, theirs in mismatches}
        everyone.update((peer, signature) for peer in bodies if peer not in everyone)
        everyone[rank] = signature
        fields = {peer: dict(field.split("=", 1) for field in sig.split(";") if "=" in field)
                  for peer, sig in sorted(everyone.items())}
        details = []
        for key in fields[rank]:
            by_value = {}
            for peer, theirs in fields.items():
                by_value.setdefault(theirs.get(key, "?"), []).append(str(peer))
            if len(by_value) > 1:
                details.append(f"{key}: " + "; ".join(
                    f"{value} on rank{'s' if len(peers) > 1 else ''} {', '.join(peers)}"
                    for value, peers in by_value.items()))
        raise ValueError("ranks disagree on the reduction: " + " | ".join(details))
    return bodies
