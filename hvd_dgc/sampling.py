"""DGC's sampled threshold settings (Lin et al., ICLR 2018, Sec. 3.1), checked once for
both frameworks' DGC compressors (hvd_dgc/torch/compression.py and
hvd_dgc/tensorflow/compression.py ``DGCCompressor`` inherit ``DGCSampling``)."""

__all__ = ["DGCSampling"]


class DGCSampling:
    """How a DGC compressor finds its threshold: ``sample_ratio`` of the tensor sampled
    (at least ``min_sample`` elements), a threshold aimed at ``window[1] * k`` entries,
    lowered by ``threshold_decay`` while fewer than ``window[0] * k`` pass, at most
    ``max_adapt_rounds`` times."""

    def __init__(self, sample_ratio=0.01, window=(0.8, 1.3), threshold_decay=0.8,
                 max_adapt_rounds=10, min_sample=2048):
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
        lo, hi = window
        if not 0.0 < lo <= 1.0 <= hi:
            raise ValueError(f"window must be (low, high) with 0 < low <= 1 <= high, got "
                             f"{window!r}")
        if not 0.0 < threshold_decay < 1.0:
            raise ValueError(f"threshold_decay must be in (0, 1), got {threshold_decay!r}")
        self.sample_ratio = float(sample_ratio)
        self.window = (float(lo), float(hi))
        self.threshold_decay = float(threshold_decay)
        self.max_adapt_rounds = int(max_adapt_rounds)
        self.min_sample = int(min_sample)

    def sampling_options(self):
        """The settings as the compressor's options (``_options``: a copy keeps them)."""
        return dict(sample_ratio=self.sample_ratio, window=self.window,
                    threshold_decay=self.threshold_decay,
                    max_adapt_rounds=self.max_adapt_rounds, min_sample=self.min_sample)
