"""Optimizers and learning-rate schedules of every benchmark, and the one rule for which parameters decay.

- :class:`~trainbench.optim.lamb.Lamb` (BERT) and :class:`~trainbench.optim.adamw.AdamClipped` (the decoders);
- :func:`~trainbench.optim.schedules.poly_warmup_lr` (BERT) and :func:`~trainbench.optim.schedules.cosine_warmup_lr`;
- :func:`~trainbench.optim.groups.weight_decay_split`: frozen parameters are left out, and biases and norms get
  no weight decay.
"""
