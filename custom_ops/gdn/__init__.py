"""Gated DeltaNet core: causal depthwise conv1d and the chunked gated delta rule on packed THD sequences."""
