"""Speculative decoding on the worker: proposers that draft tokens, and the verification of the drafts.

The scheduler gives a request lookahead (scheduler/draft_budget.py); before the step runs, the worker's
proposer writes up to that many draft tokens after the request's known tokens; the forward pass computes
all of them; `rejection.py` keeps the longest run the target model agrees with and samples one more.
"""
