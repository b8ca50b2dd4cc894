"""deepinfer's golden reference backend (plain torch on the CPU)."""
