"""Datasets in Search-R1's formats, the training prompt, and the toy world.

Kept import-light on purpose: nothing here pulls in torch, and pyarrow is imported only
by the functions that read or write parquet.
"""
