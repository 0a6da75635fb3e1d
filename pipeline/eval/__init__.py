"""The eval's machinery: the runner that times every method on one request (`runner`) and the report rendered
from the rows alone (`report`; `python -m pipeline.eval.report eval/results/<run>`)."""
