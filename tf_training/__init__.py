"""DP-SGD and DP-BandMF training on materialized batches (not yet built; see the README roadmap)."""
