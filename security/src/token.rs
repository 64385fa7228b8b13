//! Tokens, roles and path scopes.
