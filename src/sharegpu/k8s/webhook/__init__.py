"""The admission webhook for pods that ask for sharegpu resources."""
