"""Checking a reducer's average before applying it (the math; ``hivemind_ext.verified_reduce`` runs it).

In hivemind's all-reduce every peer reduces one slice of the tensors for the whole group. A peer
that receives a reducer's average ``x`` for one part asks every group member for *claims* about
that part, under a random seed it draws only now, after ``x`` is fixed:

- each sender ``i``: the distance ``|g_i - x|`` from the part it sent to the average it received,
  and a sketch of ``g_i - x`` (a CountSketch with ``BUCKETS`` buckets: every coordinate goes to a
  bucket with a random sign, so the sketch is linear, its squared norm estimates the vector's and
  a liar who does not know the seed cannot fit a vector to it);
- the reducer: the same for every sender's part it averaged, and the weights it used.

Then (``judge``): the reducer's claim about this peer's own part must match this peer's own
account (else the reducer lied to it: guilty); its claims about other senders must match theirs
(else one of the two lies, and this peer cannot tell which: the part is not applied, nobody is
blamed); and with ``centered_clip`` the average must be a fixed point of the clip over the parts
the senders confirm: ``sum_i w_i clip(g_i - x, tau)`` over the other senders may be no longer than
the reducer's own clipped part, ``w_r tau`` (plus slack for convergence and compression), where
``tau`` is ``radius`` times the median distance, recomputed here. So a reducer can move the
average no further than one clipped sender could (BTARD, Gorbunov et al. 2022, checks the same
fixed point). With ``mean`` a lie is indistinguishable from the reducer's own part being that far
off, and the mean has no defence against one bad part anyway: only the first two checks apply.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

BUCKETS = 256
ROW = 2 + BUCKETS  # a claim: weight, distance, sketch
SLACK = 0.05  # of the total weight times tau: centered clip stops within 0.005 tau of its fixed point
SPREAD = 1.6  # the sketch's squared norm over the true one stays below this (about 1e-6 odds at 256 buckets)
GUILTY, UNSURE, OK = "guilty", "unsure", "ok"


@dataclass(frozen=True)
class Tolerance:
    """The error of a delta sent back under some compression: ``rel`` of each value, and at most
    ``floor`` on each value whatever its size (fp16 rounds values below 2**-14 to steps of 2**-24,
    so a delta of gradients around 1e-6 per value is off by several percent)."""

    rel: float
    floor: float = 0.0

    def norm(self, size: int) -> float:
        """The most the fixed part of the error adds to the norm of a part of ``size`` values."""
        return self.floor * math.sqrt(size)


def tolerance(compression: str) -> Tolerance:
    """The error of a delta sent back under ``compression`` (a hivemind class name)."""
    if compression == "Float16Compression":
        return Tolerance(2.0**-8, 2.0**-25)
    if compression == "Absmax4BitQuantization":  # half a step of absmax / 7: about 12 % of the norm
        return Tolerance(0.2)
    return Tolerance(1e-5 if compression == "NoCompression" else 0.05)


def sketch(vector: torch.Tensor, seed: bytes, reducer: int, part: int) -> torch.Tensor:
    """The CountSketch of ``vector`` (flattened) for part ``part`` of reducer ``reducer``."""
    digest = hashlib.sha256(seed + reducer.to_bytes(4, "little") + part.to_bytes(4, "little")).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    flat = vector.reshape(-1).float()
    draw = torch.randint(2 * BUCKETS, flat.shape, generator=gen, dtype=torch.int32)  # bucket and sign in one
    signed = flat * ((draw & 1).float() * 2 - 1)
    return torch.zeros(BUCKETS, dtype=torch.float64).index_add_(0, (draw >> 1).long(), signed.double())


def claim(weight: float, difference: torch.Tensor, seed: bytes, reducer: int, part: int) -> torch.Tensor:
    """One claim row: ``weight``, ``|difference|`` and its sketch."""
    head = torch.tensor([weight, float(difference.double().norm())], dtype=torch.float64)
    return torch.cat([head, sketch(difference, seed, reducer, part)])


def claim_rows(seed: bytes, me: int, weight: float, received: dict | None, kept: dict, senders: int,
               parts: int) -> torch.Tensor:
    """A member's answer under ``seed``: as a sender (``received``: (reducer, part) -> the delta it
    got back, in order), one row per part of every reducer; then as reducer ``me`` (``kept``: part ->
    (sender positions, their parts, weights, the average)), one row per part and sender position,
    zeros for a sender it did not average."""
    rows = [claim(weight, -delta, seed, r, k) for (r, k), delta in (received or {}).items()]
    for k in range(parts):
        positions, values, weights, x = kept.get(k, ((), (), (), None))
        by_sender = dict(zip(positions, zip(values, weights, strict=True), strict=True))
        for s in range(senders):
            if s in by_sender:
                part, w = by_sender[s]
                rows.append(claim(w, part.float() - x.float(), seed, me, k))
            else:
                rows.append(torch.zeros(ROW, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.zeros(0, ROW, dtype=torch.float64)


@dataclass(frozen=True)
class Verdict:
    outcome: str  # GUILTY, UNSURE or OK
    reason: str = ""


def _differ(a: torch.Tensor, b: torch.Tensor, tol: Tolerance, size: int) -> bool:
    """Do two claims about the same part of ``size`` values disagree beyond what compression explains?"""
    if abs(float(a[0]) - float(b[0])) > 1e-6 * max(abs(float(a[0])), abs(float(b[0])), 1e-12):
        return True
    scale = max(float(a[1]), float(b[1]))
    allowed = 4 * (tol.rel * scale + tol.norm(size)) + 1e-9
    return abs(float(a[1]) - float(b[1])) > allowed or float((a[2:] - b[2:]).norm()) > allowed


def judge(reducer_claims: dict[int, torch.Tensor], sender_claims: dict[int, torch.Tensor], own: int | None,
          reducer_sender: int | None, radius: float | None, tol: Tolerance, size: int) -> Verdict:
    """The verdict on one part of one reducer.

    ``reducer_claims``: sender position -> the reducer's claim row about that sender's part (the
    senders it averaged); ``sender_claims``: sender position -> that sender's own row (those that
    answered, this peer's included); ``own``: this peer's sender position (None: it sent nothing);
    ``reducer_sender``: the reducer's own sender position (None if it sent nothing); ``radius``:
    the clip radius with ``centered_clip``, None with ``mean``; ``tol``: the compression's error
    (``tolerance``); ``size``: the part's number of values."""
    if own is not None and own in sender_claims:
        mine = reducer_claims.get(own)
        if mine is None or _differ(mine, sender_claims[own], tol, size):
            return Verdict(GUILTY, "its account of our part does not match the average it sent us")
    for position, theirs in sender_claims.items():
        if position in (own, reducer_sender):
            continue
        if position not in reducer_claims or _differ(reducer_claims[position], theirs, tol, size):
            return Verdict(UNSURE, f"it and sender {position} disagree about that sender's part")
    if radius is None or not reducer_claims:
        return Verdict(OK)
    rows = torch.stack(list(reducer_claims.values()))
    weights, distances = rows[:, 0].clamp_min(0), rows[:, 1]
    tau = radius * float(distances.float().median())
    total = float(weights.sum())
    others = [p for p in reducer_claims if p != reducer_sender]
    residual = torch.zeros(BUCKETS, dtype=torch.float64)
    for position in others:
        w, d = float(reducer_claims[position][0]), float(reducer_claims[position][1])
        residual += max(w, 0.0) * min(1.0, tau / max(d, 1e-30)) * reducer_claims[position][2:]
    own_weight = max(float(reducer_claims[reducer_sender][0]), 0.0) if reducer_sender in reducer_claims else 0.0
    bound = (own_weight + SLACK * total) * tau + 4 * tol.rel * total * float(distances.max())
    if float(residual.pow(2).sum()) > SPREAD * bound**2 + 1e-18:
        return Verdict(GUILTY, "its average is not the centered clip of the parts it was sent")
    return Verdict(OK)


def judge_round(peers: list, me, senders: list, lengths: list[list[int]], answers: dict, radius: float | None,
                tol: Tolerance) -> list[tuple[object, Verdict]]:
    """The verdicts that are not OK on every part of every reducer but ``me``, a guilty one last.

    ``peers``: the group in reducer order; ``senders``: those that sent parts; ``lengths[r]``: the
    sizes of reducer ``r``'s parts; ``answers``: peer -> its claim rows (``me`` included), or
    whatever went wrong asking it: a sender's rows first (one per part of every reducer, in
    order), then a reducer's (one per part and sender position, zeros for a sender it did not
    average)."""
    sent = sum(map(len, lengths))
    own = senders.index(me) if me in senders else None
    found: list[tuple[object, Verdict]] = []
    for r, reducer in enumerate(peers):
        if reducer == me or not lengths[r]:
            continue
        reply, first = answers.get(reducer), sent if reducer in senders else 0
        if not isinstance(reply, torch.Tensor) or reply.shape != (first + len(lengths[r]) * len(senders), ROW):
            found.append((reducer, Verdict(UNSURE, f"it gave no account ({reply!r:.80})")))
            continue
        as_reducer = reply[first:].reshape(len(lengths[r]), len(senders), ROW)
        offset = sum(map(len, lengths[:r]))
        for k in range(len(lengths[r])):
            mine = {s: as_reducer[k, s] for s in range(len(senders)) if float(as_reducer[k, s].abs().sum()) > 0}
            theirs = {s: answers[p][offset + k] for s, p in enumerate(senders)
                      if isinstance(answers.get(p), torch.Tensor) and answers[p].shape[0] >= sent}
            verdict = judge(mine, theirs, own, senders.index(reducer) if reducer in senders else None, radius,
                            tol, lengths[r][k])
            if verdict.outcome == GUILTY:
                return [(reducer, verdict)]
            if verdict.outcome == UNSURE:
                found.append((reducer, verdict))
                break
    return found
