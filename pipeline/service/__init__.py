"""The service layer: the tools the studio offers, loaded under a memory budget (`tools`), and the
one way a request is served under every front end (`studio`). Above it are only the front ends
(`app/`) and the composition root (`studio/`)."""
