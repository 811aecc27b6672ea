"""The entropy bonus's coefficient from step to step (`EntropyControl`): fixed
(``trainer.entropy_coef``), or adaptive to a target entropy (``trainer.entropy_target``).

Adaptive entropy control, as in the Skywork Open Reasoner 1 technical report (He et al. 2025,
arXiv 2505.22312, "Adaptive Entropy Control", and its training scripts' ``adaptive_entropy``
settings): a coefficient ``c`` in ``[0, c_max]`` moves by ``delta`` after every step, up while
the step's entropy ``H`` is below the target and down while it is at or above it; the bonus a
step applies is ``c`` while the entropy is below the target and 0 otherwise. A policy whose
entropy is above the target learns with no bonus at all (as with ``entropy_coef: 0``); one that
falls below it is pushed back with a force that grows step by step until the entropy is held.

Here the gate and the move read the entropy of the *last* step: a step's entropy is known only
once every micro-batch (and every FSDP rank) has run, and the coefficient must be one number for
the whole step so that the micro-batches' summed gradient stays the unsplit batch's. The state is
not saved with the trainer state: a restarted trainer starts from ``c = 0`` and the last entropy
unknown (no bonus until its first step reports one).
"""

from __future__ import annotations

import math


class EntropyControl:
    """The coefficient of the entropy bonus for each step.

    Fixed (``target is None``): always ``c_max``. Adaptive: see the module docstring.
    """

    def __init__(self, c_max: float, target: float | None = None, delta: float = 0.0):
        """Args:
            c_max: ``trainer.entropy_coef``: the fixed coefficient, or the adaptive one's bound (>= 0).
            target: ``trainer.entropy_target`` (nats, > 0), or None: fixed.
            delta: ``trainer.entropy_coef_delta``: the adaptive coefficient's move per step (> 0).

        Raises:
            ValueError: a negative or non-finite bound, a target that is not a positive finite
                number, or an adaptive control without a positive step.
        """
        if not (math.isfinite(c_max) and c_max >= 0):
            raise ValueError(f"entropy coefficient bound {c_max!r}: give a finite number >= 0")
        if target is not None and not (math.isfinite(target) and target > 0):
            raise ValueError(f"entropy target {target!r}: give a finite number of nats > 0")
        if target is not None and not (math.isfinite(delta) and delta > 0):
            raise ValueError(f"entropy coefficient step {delta!r}: give a finite number > 0")
        self.c_max, self.target, self.delta = float(c_max), target, float(delta)
        self.c = 0.0 if target is not None else self.c_max
        self.last_entropy: float | None = None

    def coef(self) -> float:
        """The coefficient the next step applies (>= 0; 0: no bonus and no entropy gradient)."""
        if self.target is None:
            return self.c_max
        if self.last_entropy is None or self.last_entropy >= self.target:
            return 0.0
        return self.c

    def update(self, entropy: float) -> None:
        """Record a step's mean token entropy (nats) and move the coefficient; a non-finite
        entropy (no tokens, a broken step) changes nothing."""
        if self.target is None or not math.isfinite(entropy):
            return
        self.last_entropy = float(entropy)
        step = self.delta if entropy < self.target else -self.delta
        self.c = min(self.c_max, max(0.0, self.c + step))
