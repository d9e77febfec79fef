"""Offline learners over frozen text embeddings: CQL, BC and filtered BC, d3rlpy's DiscreteCQL, FQE.

`features.build_features` turns a dataset into tensors once; each learner
(`cql`, `bc`, `d3rlpy_bridge`) trains a network whose `q_values(state_emb,
cand_emb, mask)` scores candidate actions; `policy.Policy` wraps that network
with the encoder for decision time, and `train.train` is what the `train`
verb runs. See README.md in this folder for the choices and their measurements.
"""
