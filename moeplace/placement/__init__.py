"""placement/: the Placement record, engine-faithful evaluation and dispatch rules, lower bounds, placement
policies (published baselines and the moeplace optimizer), the policy comparison and engine exports.
Imports only traces/ and foundation/."""
