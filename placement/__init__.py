"""placement/: cluster topology, the Placement record, engine-faithful evaluation, lower bounds, placement
policies (published baselines and the moeplace optimizer), engine exports and the ``place`` CLI."""
