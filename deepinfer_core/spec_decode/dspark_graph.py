"""DSpark drafting replayed from captured graphs: one graph per batch size seeds the stages' rings over
``k + 1`` positions per sequence and runs the draft pass over the stages once, from the last kept
position, which it derives on the device from how many positions each sequence kept.

The layout is :class:`~deepinfer_core.spec_decode.mtp_graph.MtpGraphs`': a step keeps 1 to k + 1 positions
of each sequence (a plain decode, or the accepted prefix of a verification plus the bonus token), and the
seeding is padded to k + 1 positions per sequence, its rows past the kept ones the last kept one's target
state. The rings' rows of positions past a sequence's last kept one then hold values of that filler;
a draft reads ring rows only up to its sequence's last kept position, and the next step's seeding
starts right after it, so each such row is written again before a draft reads it: the drafts and
confidences are the eager proposer's. Padding sequences have no blocks: what they write lands in the
trash.
"""

from __future__ import annotations

import torch

from deepinfer_core.spec_decode.mtp_graph import MtpGraphs


class DSparkGraphs(MtpGraphs):
    """Seeding and one draft pass for up to ``max(sizes)`` sequences, padded to the smallest size that
    holds them (``MtpGraphs``' static inputs, ``propose`` and device-derived layouts; ``_run`` is DSpark's).

    With ``capture=False`` (CPU tests) the padded static inputs run eagerly, exactly what a replay
    computes."""

    def _stream_shape(self) -> tuple[int, ...]:
        """A row of what the target's forward returns for the drafter: the hc-mean of each target layer's
        input, concatenated (the last layer's streams for a checkpoint without targets)."""
        cfg = self.model.cfg
        targets = len(getattr(cfg, "dspark_target_layer_ids", None) or [])
        return (targets * cfg.hidden_size,) if targets else (cfg.hc_mult, cfg.hidden_size)

    def _run(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeding and the draft pass over the static inputs of ``size``: ([size, k] drafts, the confidence
        head's probability of each)."""
        drafter, inputs, q = self.model.drafter, self.inputs[size], self.q
        catch_up = inputs.catch_up
        drafter.seed(inputs.streams, catch_up, self.cache)
        first = catch_up.positions.view(size, q)[:, 0]
        last = torch.arange(size, device=first.device) * q + inputs.accepted
        positions = first + inputs.accepted  # each sequence's last kept position
        window = positions.unsqueeze(1) + torch.arange(1 - self.window, 1, device=first.device)
        ids, _, confidence = drafter.draft(catch_up.input_ids[last], positions, self._window_rows(inputs, window),
                                           self.cache)
        return ids[:, 1: 1 + self.k], torch.sigmoid(confidence[:, : self.k])
