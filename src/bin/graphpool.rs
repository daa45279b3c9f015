//! `graphpool`: the command-line tool. All the work is in `graphpool::cli`.

fn main() -> std::process::ExitCode {
    graphpool::cli::main()
}
