"""Expert parallelism under HDP: aligned micro-batch slots per EP group, rings on whole EP
groups, and the all-to-alls' costs."""
