"""The ``ngram`` proposer (prompt lookup): drafts copied from the request's own history."""
