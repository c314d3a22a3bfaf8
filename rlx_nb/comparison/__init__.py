"""Compare: one context per output, a comparator per kind of output, each record built once, flat rows and tables of records."""
