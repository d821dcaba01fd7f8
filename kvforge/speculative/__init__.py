"""Speculative decoding: proposers guess the next tokens, the target model verifies them in one step.

``config.py`` parses ``--speculative-config``; ``proposer.py`` is the interface every proposer
implements; ``ngram.py`` the prompt-lookup proposer; ``verify.py`` the exact verification
(greedy and rejection sampling); ``support.py`` the engine-level checks made before weights load;
``stats.py`` the acceptance counters. docs/SPECULATIVE.md describes the whole path.
"""
