"""Data intake: rewarded experiences read from the ready stream, admitted or dead-lettered,
staleness counted, acknowledged once a saved state covers them."""
