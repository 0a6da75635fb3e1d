"""The sidecar: a small LM + LoRA adapter that predicts a tool call's function and every slot in one parallel wave."""
