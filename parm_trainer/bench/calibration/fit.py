"""The alpha-beta fit of measured points: least squares under alpha, beta >= 0 (on the boundary
where the points ask for a negative one), or of the relative errors."""

from __future__ import annotations

import numpy as np

from parm_trainer.moe.cost_profile import fit_alpha_beta


R2_MIN = 0.95
ALPHA_FLOOR = 1e-9   # s
BETA_FLOOR = 1e-15   # s/byte (1 PB/s)


def fit(points, relative: bool = False):
    """(alpha, beta, r2, clamped) from [(sent bytes, seconds)]. relative: least squares of
    the relative errors, so that every size counts alike (the memory rate: its largest,
    cache-missing sizes vary up to 3 x between calibrations on shared cores, and would set
    the rate alone); r2 is of the raw points either way."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    spread = float(np.sum((y - y.mean()) ** 2))
    if relative and np.all(y > 0):
        design = np.stack([1.0 / y, x / y], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
        if alpha > 0 and beta > 0:
            residual = float(np.sum((y - alpha - beta * x) ** 2))
            return float(alpha), float(beta), 1.0 - residual / spread if spread else 1.0, False
    alpha, beta, r2 = fit_alpha_beta(x, y)
    clamped = False
    if alpha <= 0 or beta <= 0:  # least squares under alpha, beta >= 0: on the boundary
        clamped = True
        if beta > 0:  # alpha at its floor, beta through the origin (a shaper's burst, or noise)
            alpha = ALPHA_FLOOR
            beta = max(float(np.dot(x, y - alpha) / np.dot(x, x)), BETA_FLOOR)
        else:         # no size dependence seen: beta at its floor, alpha the mean time
            beta = BETA_FLOOR
            alpha = max(float(np.mean(y - beta * x)), ALPHA_FLOOR)
        r2 = 1.0 - float(np.sum((y - alpha - beta * x) ** 2)) / spread if spread else 1.0
    return float(alpha), float(beta), float(r2), clamped
