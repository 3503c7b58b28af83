"""The lowering rules by op family; blade/cluster/support.py is the table that joins them."""
