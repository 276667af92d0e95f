"""Each rank's work in run order: rank items, ring slots safe for 1F1B, pipeline stage and
chunk orders, and their estimates (the pipeline graph's longest paths)."""
