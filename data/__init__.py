"""The data scripts (run as python data/NAME.py) and data.shards, the token shard format that train_gpt.py reads."""
