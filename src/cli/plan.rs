//! `graphpool plan`: predict graph memory offline, with no daemon and no session.
