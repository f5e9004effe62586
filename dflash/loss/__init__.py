"""Losses of the drafter: the term records (``terms``), the chunked verifier-logit loss
(``verifier``) and its row-block math (``kernels``), workspace and device branches."""
