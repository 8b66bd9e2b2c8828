"""Speed and memory comparisons of rankwise against the anchor libraries, side by side in one run."""
