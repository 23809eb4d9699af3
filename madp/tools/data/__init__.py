"""Data to run madp on: synthetic multi-user datasets (`synthetic`, with the text content of
`synthetic_text`) and email imported from an mbox file as multi-user records (`mbox`)."""
