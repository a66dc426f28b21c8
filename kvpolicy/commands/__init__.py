"""The commands: ``kvpolicy`` (`cli`) and what it runs (`compare`, `bench`, `profile`, `docgen`).

The top layer: the commands import the layers below them and what they share from `common`, never the
other way round (tests/test_architecture.py checks it).
"""
